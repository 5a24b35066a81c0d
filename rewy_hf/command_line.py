"""What every rewy-hf command line shares, from ``rewy-hf`` itself to the fine-tuning recipes: the
``--core`` choices and the help formatter that shows each option's default.

It sits below both ``rewy_hf.cli`` and ``rewy_hf.training`` so that each can use it without one
importing the other upwards.
"""

from __future__ import annotations

import argparse

# --core: rewy's delta-rule core, or the model's own (nothing patched)
CORES = ("rewy", "original")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default. Options whose default is None or False get no
    "(default: None)": their help says what leaving them out does, often per device."""

    # The one hook argparse offers for this (ArgumentDefaultsHelpFormatter overrides it too).
    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)
