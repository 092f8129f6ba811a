"""The ``paged-jax`` console script: ``generate`` (the main demo), ``chat``, ``serve``,
``perplexity``, ``embed`` and ``bench``, a module each (``generate.py``, ``serve.py``,
``tools.py``) over what they share (``common.py``) and the argument parser
(``flags.py``).

Bad input is a one-line ``paged-jax: error: ...`` on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import errno
import os
import sys

from paged_jax.cli import generate, serve, tools
from paged_jax.cli.common import (  # noqa: F401 (install_extra, flag_names: tests read them here)
    INTERRUPTS,
    Unavailable,
    UsageError,
    flag_names,
    install_extra,
)
from paged_jax.cli.flags import _parser

# (the names tests and scripts read here)
_flag_names = flag_names
_install_extra = install_extra


def main(argv: list[str] | None = None) -> int:
    """``paged-jax ARGV``: the command's exit status (0, 1: something it needs is not
    there, 2: bad input, one line on stderr; 130: interrupted)."""
    try:
        with INTERRUPTS:
            return _main(argv)
    except KeyboardInterrupt:  # before _main's own handling (the parser) or held to its end
        print("paged-jax: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
        run = {
            "generate": generate.generate,
            "chat": generate.chat,
            "serve": serve.serve,
            "perplexity": tools.perplexity,
            "embed": tools.embed,
            "bench": tools.bench,
        }[args.command]
        code = run(args)
        sys.stdout.flush()  # a write error shows here, not as a traceback at exit
        return code
    except UsageError as e:
        print(f"paged-jax: error: {e}", file=sys.stderr)
        return 2
    except Unavailable as e:
        print(f"paged-jax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the engine let its step finish; nothing half-done remains
        print("paged-jax: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EBADF):
            raise
        # stdout is closed, full or gone: say so once, and stop Python's exit-time flush
        # of the same buffer from printing a traceback of its own.
        silence_stdout()
        if e.errno != errno.EPIPE:  # a closed pipe (e.g. `| head`) is the reader's choice
            print(f"paged-jax: error: cannot write the output ({e.strerror})", file=sys.stderr)
        return 2


def silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The console script: ``main()``, then exit with its status.

    After Ctrl-C the process ends without Python's finalization: an interrupted JAX call
    can leave XLA worker threads running, and tearing the interpreter and jaxlib down
    under them crashed (SIGSEGV in C++, no Python frame, after "interrupted" had been
    printed: about 1 in 40 interrupts in our runs). Output is flushed first."""
    code = main()
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    sys.exit(code)
