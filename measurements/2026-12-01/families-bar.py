"""Issue #15's bar as a user would try it: per family, a tiny random model from its transformers config, greedy
`qtool generate --temperature 0` on a short and a long prompt against transformers' `generate`, and
`qtool quantize --recipe int4-rtn` followed by `qtool generate` on the checkpoint. Writes families-bar.json.

Run: python3 measurements/2026-12-01/families-bar.py  (from the repository root; about 5 minutes on 2 cores)
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from qtoolkit.model.sources import resolve_model

SHORT = "def add(a, b):\n    return"
LONG = ("Summarize: the committee met on Tuesday to review the budget. After a long debate about the roads, the "
        "schools and the new library, the members agreed to postpone the vote until the auditors had finished "
        "their report, which is expected next month. ") * 2
NEW = 20


def configs(tok):
    c = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
             pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    return {
        "llama3-rope": LlamaConfig(**c, intermediate_size=128, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**c, intermediate_size=128),
        "qwen3": Qwen3Config(**c, intermediate_size=128, head_dim=32),
        "gemma3_text": Gemma3TextConfig(**{**c, "tie_word_embeddings": True}, intermediate_size=128, head_dim=16,
                                        sliding_window=12, layer_types=["sliding_attention", "sliding_attention",
                                                                        "full_attention", "sliding_attention"]),
        "mistral-window16": MistralConfig(**c, intermediate_size=128, sliding_window=16),
        "qwen3_moe": Qwen3MoeConfig(**c, intermediate_size=128, moe_intermediate_size=32, head_dim=32, num_experts=4,
                                    num_experts_per_tok=2),
        "mixtral": MixtralConfig(**c, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=None),
    }


def qtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtoolkit.cli", *args], capture_output=True, text=True, timeout=900)


def main() -> None:
    tok_dir = resolve_model("default").path
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        only = os.environ.get("FAMILIES")  # e.g. FAMILIES=qwen2,mixtral
        for name, cfg in configs(tok).items():
            if only and name not in only.split(","):
                continue
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).float().eval()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.mul_(10.0)  # sharp logits: no near-ties in greedy argmax
            folder = Path(tmp) / name
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            row = {"model_type": cfg.model_type}
            # the reference encodes and decodes with the tokenizer `qtool` reads from the folder: saved beside a
            # qwen2 config it loads as Qwen2Tokenizer, whose ids differ from the source tokenizer's
            folder_tok = AutoTokenizer.from_pretrained(folder)
            for label, prompt in (("short", SHORT), ("long", LONG)):
                ids = folder_tok(prompt, return_tensors="pt").input_ids
                with torch.no_grad():
                    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:]
                want = folder_tok.decode(ref, skip_special_tokens=True)
                r = qtool("generate", "--model", str(folder), "--prompt", prompt, "--temperature", "0",
                          "--max-tokens", str(NEW))
                row[f"{label}_prompt_tokens"] = ids.shape[1]
                row[f"{label}_equal"] = r.returncode == 0 and r.stdout == want + "\n"
                if not row[f"{label}_equal"]:
                    row[f"{label}_detail"] = (r.returncode, r.stdout[-200:], want[-200:], r.stderr[-300:])
            q = qtool("quantize", "--model", str(folder), "--recipe", "int4-rtn", "--output", str(folder) + "-int4")
            row["int4_rtn_quantize_rc"] = q.returncode
            g = qtool("generate", "--model", str(folder) + "-int4", "--prompt", SHORT, "--temperature", "0",
                      "--max-tokens", "8") if q.returncode == 0 else None
            row["int4_generate_rc"] = None if g is None else g.returncode
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    out = Path(__file__).with_name("families-bar.json" if not only else f"families-bar-{only.replace(',', '-')}.json")
    out.write_text(json.dumps({"command": "python3 measurements/2026-12-01/families-bar.py", "families": rows},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
