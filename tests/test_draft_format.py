"""The EAGLE-3 head and its vLLM folder format: names and shapes as vLLM's loader expects, incremental steps equal
one causal pass, and a head that does not fit the target fails to load with one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from qtoolkit.draft.format import load_head, save_head
from qtoolkit.draft.head import DraftKV, Eagle3Config, Eagle3Head, default_aux_layer_ids
from qtoolkit.errors import DraftHeadError
from qtoolkit.model.llama import ModelConfig


def target_config(hidden: int = 64, layers: int = 4, vocab: int = 300, heads: int = 4, kv: int = 2) -> ModelConfig:
    return ModelConfig.from_hf({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": heads,
                                "num_key_value_heads": kv, "rms_norm_eps": 1e-5})


def make_head(target: ModelConfig, draft_vocab: int = 50, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    head.set_vocab(torch.randperm(target.vocab_size)[:draft_vocab])
    return head.eval()


def vllm_expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """What vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights, LlamaModel and its
    first LlamaDecoderLayer) builds from config.json: `midlayer.` is renamed `layers.0.`; q/k/v are stacked into
    a QKVParallelLinear over 2 * hidden_size inputs ([normed embeds, normed hidden]); gate/up into gate_up_proj;
    `fc` is a ReplicatedLinear from 3 * target_hidden_size, no bias; `lm_head` a ParallelLMHead of
    draft_vocab_size rows; `d2t` loads into draft_id_to_target_id (int64, draft_vocab_size); `t2d` is skipped;
    without `embed_tokens` the target's embedding is shared."""
    h, th, n, v = cfg["hidden_size"], cfg["target_hidden_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    hd, heads, kvh, inter = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    return {
        "fc.weight": (h, 3 * th), "norm.weight": (h,), "lm_head.weight": (n, h), "d2t": (n,), "t2d": (v,),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
    }


def test_saved_folder_has_vllm_names_shapes_and_config(tmp_path):
    target = target_config(layers=30, hidden=64)
    head = make_head(target)
    save_head(head, tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 50 and cfg["vocab_size"] == 300
    # vLLM's default taps for a 30-layer target (get_eagle3_aux_hidden_state_layers: 2, L // 2, L - 3)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    with safe_open(str(tmp_path / "head" / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert shapes == vllm_expected_shapes(cfg)
    assert not any(k.startswith(("model.", "layers.")) for k in shapes)


def test_round_trip_and_vocabulary_maps(tmp_path):
    target = target_config()
    head = make_head(target)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    ids = torch.arange(50)
    assert torch.equal(back.to_target(ids), head.to_target(ids))
    assert back.t2d.sum() == 50 and bool(back.t2d[head.to_target(ids)].all())
    x = torch.randn(3, 64)
    assert torch.equal(back.fuse(torch.randn(3, 192).zero_()), torch.zeros(3, 64))
    kv1, kv2 = DraftKV.empty(head.config), DraftKV.empty(back.config)
    pos = torch.arange(3)
    assert torch.allclose(head.step(x, x, pos, kv1)[1], back.step(x, x, pos, kv2)[1])


def test_incremental_steps_equal_one_causal_pass_and_truncate():
    head = make_head(target_config())
    emb, hid, pos = torch.randn(6, 64), torch.randn(6, 64), torch.arange(6)
    kv = DraftKV.empty(head.config)
    out_all, logits_all = head.step(emb, hid, pos, kv)
    assert len(kv) == 6
    kv.truncate(4)
    assert len(kv) == 4
    out_last, logits_last = head.step(emb[4:], hid[4:], pos[4:], kv)
    assert torch.allclose(out_last, out_all[4:], atol=1e-5) and torch.allclose(logits_last, logits_all[4:], atol=1e-5)
    kv = DraftKV.empty(head.config)
    for i in range(6):
        out_i, _ = head.step(emb[i:i + 1], hid[i:i + 1], pos[i:i + 1], kv)
        assert torch.allclose(out_i[0], out_all[i], atol=1e-5)


def test_default_aux_ids_stay_inside_tiny_targets():
    for layers in range(2, 40):
        ids = default_aux_layer_ids(layers)
        assert all(1 <= i <= layers - 1 for i in ids) and list(ids) == sorted(ids)


@pytest.mark.parametrize("change,words", [
    (dict(hidden=32, heads=2, kv=1), "hidden size"),
    (dict(vocab=301), "vocabulary"),
    (dict(layers=2), "aux layer ids"),
])
def test_head_for_another_target_fails_with_one_line(tmp_path, change, words):
    save_head(make_head(target_config(layers=6)), tmp_path / "h")
    with pytest.raises(DraftHeadError) as e:
        load_head(tmp_path / "h", target_config(**{**dict(layers=6), **change}))
    assert words in str(e.value) and "\n" not in str(e.value) and "qtool train-draft" in str(e.value)


def test_broken_folders_fail_with_one_line(tmp_path):
    target = target_config()
    cases = {}
    cases["no such folder"] = tmp_path / "absent"
    save_head(make_head(target), tmp_path / "garbage")
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x00" * 64)
    cases["not a safetensors file"] = tmp_path / "garbage"
    save_head(make_head(target), tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    cases["is not safetensors"] = tmp_path / "bin"
    save_head(make_head(target), tmp_path / "arch")
    cfg = json.loads((tmp_path / "arch" / "config.json").read_text())
    (tmp_path / "arch" / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    cases["is not LlamaForCausalLMEagle3"] = tmp_path / "arch"
    (tmp_path / "noconf").mkdir()
    cases["config.json is missing"] = tmp_path / "noconf"
    for words, folder in cases.items():
        with pytest.raises(DraftHeadError) as e:
            load_head(folder, target)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
