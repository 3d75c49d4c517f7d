#!/usr/bin/env bash
# Export kda_edu at each COMMIT into .builds/COMMIT/kda_edu (git-ignored), for bench/experiments/bisect_recall_run.py:
#   bash bench/device/export_builds.sh <commit> [<commit> ...]      # then carry ".builds" to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
for commit in "$@"; do
  sha=$(git rev-parse --short "$commit^{commit}")
  rm -rf ".builds/$sha" && mkdir -p ".builds/$sha"
  git archive "$sha" kda_edu | tar -x -C ".builds/$sha"
  echo "$sha" > ".builds/$sha/COMMIT"
  echo "exported $sha: $(du -sh ".builds/$sha" | cut -f1)"
done
