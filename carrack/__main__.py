import sys

from carrack.cli import main

sys.exit(main())
