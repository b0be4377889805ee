import sys

from dynamig.cli import main

sys.exit(main())
