"""Shared command-line plumbing for ``kvd`` and ``kvctl``.

Errors are one line on stderr: ``PROG: error: MESSAGE``. Exit codes follow
kvctl's contract: 2 for bad usage or input (click's own convention too).
"""

from __future__ import annotations

import math
import sys
from typing import Any, NoReturn

import click

from kvd.units import SizeError, parse_size

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Abort the command with a one-line error."""
    raise click.exceptions.Exit(_print_error(message, code))


def _print_error(message: str, code: int) -> int:
    prog = click.get_current_context(silent=True)
    name = prog.find_root().info_name if prog is not None else "kvd"
    click.echo(f"{name}: error: {message}", err=True)
    return code


class SizeType(click.ParamType):  # type: ignore[type-arg]
    """A byte size such as 3.8GiB or 4GB (IEC and SI both explicit)."""

    name = "size"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except SizeError as exc:
            self.fail(str(exc), param, ctx)


class FiniteFloat(click.FloatRange):
    """A float range that refuses nan and infinities: click's own ranges let
    them through (every comparison with nan is false), and they cannot be
    sent as JSON or slept on."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def run(group: click.Group, prog: str) -> NoReturn:
    """Run a click group, printing usage errors as one line with exit code 2."""
    try:
        result = group.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"{prog}: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo(f"{prog}: aborted", err=True)
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
