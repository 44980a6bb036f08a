import sys

from mooncake_ep_switch.apps.cli import main

sys.exit(main())
