"""The errors users (not bugs) cause, in one registry: the CLI and every rank print them as one line.

    from yatt_hpc.errors import USER_ERRORS, InputError
    except USER_ERRORS as err: print(err)        # names the field or file, the value and the fix; exit 2

Each component keeps its own exception class next to the code that raises it; this module only
lists them (and holds `InputError`, for input files that the filesystem checks find unusable).
"""
from __future__ import annotations

from yatt_hpc.ckpt.errors import DiskFullError
from yatt_hpc.comm.world import LaunchMismatch
from yatt_hpc.config import ConfigError
from yatt_hpc.data.prompts import DatasetError
from yatt_hpc.data.tokenizer import TokenizerError
from yatt_hpc.placement import PlanError
from yatt_hpc.reward.errors import RewardError
from yatt_hpc.vision.images import ImageError


class InputError(Exception):
    """A missing or unusable input file; the message names the field, the path and the fix."""


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, PlanError, LaunchMismatch, DatasetError, InputError,
                                                DiskFullError, TokenizerError, RewardError, ImageError)
