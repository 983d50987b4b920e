import sys

from trainfit.cli import main

sys.exit(main())
