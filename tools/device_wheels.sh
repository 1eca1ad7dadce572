#!/usr/bin/env bash
# The wheels a GPU machine lacks (its image has Python 3.12, torch, triton, transformers, pytest, hypothesis,
# pluggy), fetched here into the git-ignored .whl/ for a device call to carry (tools/gpu_suite.sh installs them):
#   bash tools/device_wheels.sh
# Every manylinux tag up to 2_34 is listed: pip matches a tag exactly, and without a wheel's own tag it takes an
# older release silently (llguidance 1.9 is 2_31 only; 1.6 failed the grammar tests). The packages the image
# already holds are removed again (two versions of one package stop the install there).
set -e
cd "$(dirname "$0")/.."
platforms=""
for n in 34 31 28 27 24 17 5; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  gguf pydantic-settings litestar uvicorn "llguidance>=1.9" ninja pytest-xdist openai anthropic jsonschema pexpect httpx
cd .whl
rm -f numpy-* PyYAML-* pyyaml-* requests-* urllib3-* certifi-* charset_normalizer-* packaging-* pluggy-* \
  pytest-[0-9]* iniconfig-* tqdm-* pygments-*
ls | wc -l | xargs echo "wheels in .whl:"
du -sh . | cut -f1 | xargs echo "size (the carry limit is 64 MiB):"
