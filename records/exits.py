"""The exit-code contract every command of the suite keeps (docs/EXIT_CODES.md): 0 done (the gate holds), 1 the
gate failed or a regression was found, 2 the run could not judge. `run_main` gives a command's `main` that
contract for what its own code does not catch: records that cannot be written, a crash of any kind (a Rust panic
under pyo3 is a BaseException), and a `SystemExit` carrying a message (Python would exit 1 with it)."""
from __future__ import annotations

import sys
import traceback
from typing import Callable

EXIT_OK, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2


def run_main(main: Callable[[], object], kinds: tuple[str, ...] = ()) -> int:
    """Run `main()` and return its exit code: its own int where it returns one (0 where it returns anything
    else), else 2 with one line on stderr (a traceback too for a crash). `kinds`: the record kinds it appends,
    checked writable before it starts."""
    from records import store

    try:
        for kind in kinds:
            store.ensure_writable(kind)
        code = main()
    except store.RecordsUnwritable as e:
        print(f"error: {e}: the run cannot be recorded", file=sys.stderr)
        return EXIT_REFUSED
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        print(f"error: {e.code}", file=sys.stderr)
        return EXIT_REFUSED
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException:       # noqa: BLE001 -- a crash of any kind could not judge
        traceback.print_exc()
        return EXIT_REFUSED
    return code if isinstance(code, int) and not isinstance(code, bool) else EXIT_OK
