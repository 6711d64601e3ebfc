"""`qtool generate`: one-off completions through the serving engine (streamed when there is one prompt)."""

from __future__ import annotations

import argparse
import sys

HELP = "generate completions for one or more prompts with the built-in engine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder, a .gguf file or a "
                                                       "compressed-tensors checkpoint")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32 or bfloat16")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 512MiB")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.engine import Engine, SamplingParams
    from qtoolkit.engine.params import EngineInputError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    params.validate()  # bad flags fail before the model loads
    engine = Engine(args.model, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, batching=args.batching)
    prompts = args.prompt
    if args.chat:
        if not engine.tokenizer.chat_template:
            raise EngineInputError(f"{engine.model_name} has no chat template: drop --chat")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    if len(prompts) == 1:
        engine.add_request("cli", prompts[0], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for i, out in enumerate(engine.generate(prompts, params)):
        print(f"=== [{i}] ({out.num_output_tokens} tokens, {out.finish_reason})")
        print(out.text)
    return 0
