"""Writes the EAGLE-3 head in this folder with vLLM's `speculators` library itself (not qtoolkit's writer), plus
the draft logits speculators' own forward gives for fixed inputs, so tests/test_draft_speculators.py checks the
format and the arithmetic against the library that defines them.

Run once, in a venv that has speculators (it is not a qtoolkit dependency: it pins torchvision/torchaudio):
    python -m venv --system-site-packages /tmp/spec && /tmp/spec/bin/pip install --no-deps speculators==0.9.0 \
        openai hs-connectors httpx2
    /tmp/spec/bin/python tests/data/speculators-eagle3/make.py
The head fits a 4-layer LLaMA of hidden size 16 over SmolLM2's 49,152-token vocabulary (tests build that target).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, DRAFT_VOCAB, AUX = 49152, 16, 64, [1, 2, 3]


def main() -> None:
    torch.manual_seed(0)
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=2048)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False,
        target_hidden_size=HIDDEN, eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="tiny-llama-h16", architectures=["LlamaForCausalLM"])))
    # eager attention: the default flex attention computes on the CPU with errors of 2e-4 even in float64
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(config).float().eval()
    assert model._attn_impl == "eager"
    with torch.no_grad():  # weights of a trained head's scale, norms not all ones, so a swapped name shows
        for w in model.parameters():
            w.copy_(1 + 0.1 * torch.randn_like(w) if w.dim() == 1 else torch.randn_like(w) / w.shape[1] ** 0.5)
    ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(DRAFT_VOCAB))
    # bf16 on disk, as trained heads ship (and half the fixture's size); the reference runs on the same values
    model.to(torch.bfloat16).save_pretrained(HERE / "head", safe_serialization=True)
    # the config class's source, which save_pretrained copies for trust_remote_code, is speculators' code, not
    # part of the format vLLM reads
    (HERE / "head" / "config.py").unlink(missing_ok=True)
    # the reference from a fresh model holding the saved weights (the bf16 cast above also rounded its rotary
    # frequencies, a buffer save_pretrained does not write), in float64 so the test can hold qtoolkit's head to
    # float64 rounding
    model = Eagle3DraftModel(config)
    model.load_state_dict(load_file(str(HERE / "head" / "model.safetensors")), strict=False)
    model = model.double().eval()

    # speculators' forward, one step (no teacher forcing): the logits its lm_head gives for fixed inputs (fp32
    # inputs, so both sides read the same values)
    T = 6
    aux = torch.randn(1, T, len(AUX) * HIDDEN)
    input_ids = torch.randint(0, VOCAB, (1, T))
    positions = torch.arange(T)[None] + 3
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux.double(), input_ids=input_ids, document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=positions, ttt_steps=1)
    hook.remove()
    save_file({"aux": aux[0].contiguous(), "input_ids": input_ids[0].contiguous(),
               "positions": positions[0].contiguous(), "logits": seen[0][0].contiguous()},
              str(HERE / "expected.safetensors"))


if __name__ == "__main__":
    main()
