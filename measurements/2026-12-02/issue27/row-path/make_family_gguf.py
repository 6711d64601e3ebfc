"""A random Qwen2 model of about 75M parameters as a Q4_K_M GGUF (llama.cpp's own llama-quantize), for `qtool bench
decode` against llama.cpp on a family other than the default model's.

    python measurements/2026-12-02/issue27/row-path/make_family_gguf.py /tmp/qwen2-q4km

writes DIR/qwen2-q4_k_m.gguf (and the F32 GGUF it was quantized from). The model is built and written by the test
suite's own GGUF writer (tests/gguf_files.py), at sizes the K-quant blocks accept (rows of 256).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from gguf_files import build_model, llama_quantize, write_gguf  # noqa: E402

from qtoolkit.model.sources import resolve_model  # noqa: E402

SIZES = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 8,
         "num_key_value_heads": 2, "use_sliding_window": False}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, _ = build_model("qwen2", resolve_model("default").path, **SIZES)
    print(f"qwen2: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    f32 = write_gguf(model, out / "qwen2-f32.gguf")
    kinds = llama_quantize(f32, out / "qwen2-q4_k_m.gguf", "Q4_K_M")
    print(f"wrote {out / 'qwen2-q4_k_m.gguf'}: blocks {sorted(kinds)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
