import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qtoolkit.model.sources import resolve_model

src = resolve_model("default").path
tok = AutoTokenizer.from_pretrained(src)
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
msgs = [
    [
        {
            "role": "user",
            "content": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
        }
    ],
    [
        {
            "role": "user",
            "content": "Summarize in two sentences: The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground and benches. The council agreed to fund the project next year, and work will start in spring.",
        }
    ],
]
torch.set_num_threads(1)
texts = []
with torch.no_grad():
    for msg in msgs:
        ids = tok.apply_chat_template(msg, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        out = m.generate(ids, max_new_tokens=80, do_sample=False)
        texts.append((ids.shape[1], out))
    full = m.model.layers
    L = len(full)
    pats = {
        "first16": list(range(16)),
        "f6l6": list(range(6)) + list(range(L - 6, L)),
        "f8l8": list(range(8)) + list(range(L - 8, L)),
        "f10l10": list(range(10)) + list(range(L - 10, L)),
        "f4l12": list(range(4)) + list(range(L - 12, L)),
        "odd-mid": [i for i in range(L) if i < 4 or i >= L - 4 or i % 2 == 0],
        "f12l4": list(range(12)) + list(range(L - 4, L)),
        "f3l3": list(range(3)) + list(range(L - 3, L)),
        "f15l6": list(range(15)) + list(range(L - 6, L)),
    }
    for name, keep in pats.items():
        m.model.layers = torch.nn.ModuleList(full[i] for i in keep)
        m.config.num_hidden_layers = len(keep)
        for j, layer in enumerate(m.model.layers):
            layer.self_attn.layer_idx = j
        agree = []
        for n, out in texts:
            lg = m(out, use_cache=False).logits[0, n - 1 : -1].argmax(-1)
            agree.append((lg == out[0, n:]).float().mean().item())
        print(name, len(keep), [round(a, 2) for a in agree], flush=True)
        for j, layer in enumerate(full):
            layer.self_attn.layer_idx = j
        m.model.layers = full
        m.config.num_hidden_layers = L
