"""`python -m zerokit.deepspeed.install script.py args...`: run a training script with zerokit.deepspeed.install()
done first, so that the script (and the transformers, accelerate or lightning it imports) reaches zerokit where it
reaches for DeepSpeed, with no edit to the script. `-m module args...` runs a module instead. Under torchrun:

    torchrun --nproc_per_node 2 -m zerokit.deepspeed.install train.py --deepspeed ds_config.json

In code, call zerokit.deepspeed.install() (this file is the command; importing it is refused, so that the name
`zerokit.deepspeed.install` stays the function).
"""

from __future__ import annotations

import sys

from zerokit._support.run_script import run_as_python

USAGE = "usage: python -m zerokit.deepspeed.install (script.py | -m module) [args...]"


def main(argv: list[str]) -> None:
    from zerokit.deepspeed.aliases import install

    run_as_python(argv, USAGE, first=install)


if __name__ == "__main__":
    main(sys.argv[1:])
else:
    raise ImportError("zerokit.deepspeed.install is the command `python -m zerokit.deepspeed.install script.py ...`; "
                      "in code call zerokit.deepspeed.install()")
