import sys

from vocalis.cli import main

sys.exit(main())
