"""Suite-wide settings."""

import os

# Test processes hold live gRPC state while they start children with a preexec_fn
# (PR_SET_PDEATHSIG). gRPC's fork handlers then sometimes abort the child between
# fork and exec; the tests fork only to exec, so they need no fork support.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
