#!/usr/bin/env bash
# The one test command: set up (idempotent), then run pytest with any extra arguments,
# e.g. scripts/test.sh -m "not slow"
set -euo pipefail
exec "$(dirname "$0")/setup.sh" --tests "$@"
