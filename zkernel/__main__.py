"""``python -m zkernel ...`` runs the command line, as the ``zkernel`` script does."""

import sys

from zkernel.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
