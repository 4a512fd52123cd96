#!/usr/bin/env bash
# Set up (first time) and run trainplan's main job: plan the tiny Llama for this CPU, train it
# on Shakespeare, and report prediction beside measurement. Extra arguments go to `trainplan demo`.
set -euo pipefail
# the extras the demo uses: [run] (8/4-bit AdamW, progress bars) and [demo] (the corpus); no test tools
EXTRAS=run,demo source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
trainplan demo "$@"
