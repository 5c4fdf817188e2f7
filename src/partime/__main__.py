"""The ``partime`` command (and ``python -m partime``): ``partime_tools.cli`` when the tools extra is installed.

Without the extra it exits with a message that names the missing package and the command that
installs it, rather than a traceback.
"""

from __future__ import annotations

import sys

EXTRA_MODULES = {
    "click": "click",
    "rich": "rich",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "psutil": "psutil",
}
"""What the tools extra brings: importable name → distribution name."""


def main() -> None:
    """Run ``partime_tools.cli.main``; exit with status 1 and ``pip install partime[tools]`` if the extra is missing."""
    try:
        from partime_tools.cli import main as cli
    except ImportError as error:
        # Only a missing package of the extra is the user's to install; any other import error is a bug.
        top = (error.name or "").partition(".")[0]
        if top not in EXTRA_MODULES:
            raise
        sys.exit(
            f"partime: the command needs the tools extra ({EXTRA_MODULES[top]} is not installed): "
            "pip install partime[tools]"
        )
    cli(prog_name="partime")


if __name__ == "__main__":
    main()
