"""The plugin contract's old home, kept so plugins written against it still import: everything
here is ``twophase.contract``'s."""

from twophase.contract import *  # noqa: F403
from twophase.contract import __all__  # noqa: F401
