import sys

from mooncake_ep_switch.cli import main

sys.exit(main())
