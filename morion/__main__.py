import sys

from morion.cli import main

sys.exit(main())
