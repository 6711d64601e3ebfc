"""`qtool-lm-eval`: lm-eval's own CLI with the `qtoolkit` model registered, our tasks included, no network.

    qtool-lm-eval run --model qtoolkit --model_args pretrained=default,backend=engine \\
        --tasks qtoolkit_aclsum_aspect --limit 10

Every lm-eval subcommand and flag works as documented upstream; `--include_path` defaults to our tasks.
"""

from __future__ import annotations

import sys

from .run import TASKS_DIR, go_offline


def main(argv: list[str] | None = None) -> int:
    go_offline()  # lm_eval (an optional dependency) reads the offline switches when imported: set them first
    from lm_eval.__main__ import cli_evaluate

    from . import model as lm_eval_model  # noqa: F401  (registers the `qtoolkit` model)

    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args and any(a in ("run", "ls", "validate") or a.startswith("--tasks") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["qtool-lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
