"""`qtool generate`: one-off completions through the serving engine (streamed when there is one prompt)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..engine.config import EngineConfig, add_engine_args
from ..engine.params import EngineInputError, SamplingParams

if TYPE_CHECKING:
    from ..engine import Engine

HELP = "generate completions for one or more prompts with the built-in engine"


EXAMPLES = """\
examples:
  qtool generate --model default --chat --prompt "Write a haiku about rust"
  qtool generate --model out/int4 --prompt "def fib(n):" --max-tokens 64 --temperature 0.7 --seed 1
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder, a .gguf file or a "
                                                       "compressed-tensors checkpoint")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from qtoolkit.engine import Engine  # start-up time: torch loads only when the command runs

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    params.validate()  # bad flags fail before the model loads
    engine = Engine(args.model, EngineConfig.from_args(args))
    prompts = args.prompt
    if args.chat:
        if not engine.tokenizer.chat_template:
            raise EngineInputError(f"{engine.model_name} has no chat template: drop --chat")
        # the template writes the file's <bos> itself: its text is tokenized without adding another (as the
        # server does), or a GGUF whose tokenizer adds <bos> (Gemma) would read two
        prompts = [engine.tokenizer(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False).input_ids for p in prompts]
    if len(prompts) == 1:
        engine.add_request("cli", prompts[0], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        _print_speculative(engine)
        return 0
    for i, out in enumerate(engine.generate(prompts, params)):
        print(f"=== [{i}] ({out.num_output_tokens} tokens, {out.finish_reason})")
        print(out.text)
    _print_speculative(engine)
    return 0


def _print_speculative(engine: Engine) -> None:
    spec = engine.stats().speculative
    if spec is not None:
        print(f"[speculative {spec.proposer}: {spec.accepted_tokens}/{spec.draft_tokens} drafts accepted "
              f"({spec.acceptance_rate:.0%}), {spec.mean_accepted_length:.2f} tokens per verification]",
              file=sys.stderr)
