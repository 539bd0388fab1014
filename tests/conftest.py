"""Suite-wide setup: Ray binds to loopback, and no test reaches the network."""

import os

# Must be set before Ray starts anywhere in this process or its children.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Make sure no real AWS credentials or endpoints leak into tests.
for _var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
    os.environ.pop(_var, None)
