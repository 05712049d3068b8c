"""The ``pacer`` command: one entry point, one subcommand per job.

    pacer sim [SGLang flags] [--sim-* flags]   the simulated SGLang engine
    pacer serve --policy FILE [--port N]       the proxy (front door, pacing, control)
    pacer check-policy FILE                    validate a policy file without starting anything
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> "module:function"; each function takes the remaining argv and returns an exit code.
SUBCOMMANDS: dict[str, str] = {
    "sim": "proxy.sim.cli:main",
    "serve": "proxy.server.cli:serve_main",
    "check-policy": "proxy.server.cli:check_policy_main",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    target = SUBCOMMANDS.get(name)
    if target is None:
        print(f"pacer: unknown command {name!r}; expected one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
