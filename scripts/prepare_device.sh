#!/usr/bin/env bash
# Get a checkout ready for scripts/device_check.sh on a lent GPU machine (the `device` tool).
#
# That machine starts bare and reaches nothing, and the ../shared folder beside this checkout
# does not travel with it: this packs Omniglot's PNG folders (32,460 small files) into one
# archive, .device-data/omniglot.tar.gz (about 12 MB), which .gitignore keeps out of git and
# `carry` takes along; device_check.sh unpacks it there.
#
#     bash scripts/prepare_device.sh [OMNIGLOT_ROOT]     # default: $METALEARN_DATA or ../shared/data/omniglot
#
# Then call the device tool's run with
#     command: bash scripts/device_check.sh      carry: [".device-data"]      timeout_s: 590
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-${METALEARN_DATA:-../shared/data/omniglot}}"
for part in images_background images_evaluation; do
    if [ ! -d "$src/$part" ]; then
        echo "no $src/$part: pass the Omniglot root (the folder holding images_background/)" >&2
        exit 1
    fi
done
rm -rf .device-data
mkdir -p .device-data
tar -czf .device-data/omniglot.tar.gz -C "$src" images_background images_evaluation
count=$(tar -tzf .device-data/omniglot.tar.gz | grep -c '\.png$')
echo "packed $count drawings into .device-data/omniglot.tar.gz ($(du -h .device-data/omniglot.tar.gz | cut -f1))"
