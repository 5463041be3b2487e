"""argparse's parser with the error first: every parlab command line (``parlab``, the labs, ``parlab grade``,
``parlab plan``, ...) builds its parser from `ArgumentParser`.

argparse answers a bad argument with the whole usage (ten lines for ``parlab plan``) and the one line that says
what is wrong at the bottom. Here the error comes alone, followed by where to read the usage:

    parlab plan: error: argument --nodes: invalid int value: 'x'
    (parlab plan --help lists every option)

The exit status stays argparse's 2. Subparsers (``parser.add_subparsers()``) are built from the same class.
"""
from __future__ import annotations

import argparse
import sys

from parlab.i18n.catalogue import _

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        """Print '<prog>: error: <message>' and where the usage is, then exit with status 2."""
        sys.stderr.write(_("{prog}: error: {message}").format(prog=self.prog, message=message) + "\n")
        sys.stderr.write(_("({prog} --help lists every option)").format(prog=self.prog) + "\n")
        sys.exit(2)
