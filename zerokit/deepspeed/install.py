"""`python -m zerokit.deepspeed.install script.py args...`: run a training script with zerokit.deepspeed.install()
done first, so that the script (and the transformers, accelerate or lightning it imports) reaches zerokit where it
reaches for DeepSpeed, with no edit to the script. `-m module args...` runs a module instead. Under torchrun:

    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install train.py --deepspeed ds_config.json

In code, call zerokit.deepspeed.install() (this file is the command; importing it is refused, so that the name
`zerokit.deepspeed.install` stays the function).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m zerokit.deepspeed.install (script.py | -m module) [args...]"


def main(argv: list[str]) -> None:
    from zerokit.deepspeed.aliases import install

    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # where `python script.py` would look first
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
else:
    raise ImportError("zerokit.deepspeed.install is the command `python -m zerokit.deepspeed.install script.py ...`; "
                      "in code call zerokit.deepspeed.install()")
