"""``python -m loraplex.client health --server HOST:PORT``: the readiness probe."""

import sys

from .grpc_client import main

sys.exit(main())
