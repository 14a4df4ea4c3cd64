#!/usr/bin/env bash
# The Hugging Face-facing tests on the oldest transformers Oases supports (README: "Versions").
# .venv-tf-oldest is a venv that sees .venv's packages (torch, oases' extension, ...) through a
# .pth file, with transformers 5.0.0 and the dependencies it pins installed in front of them.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.0.0
VENV=.venv-tf-oldest
if ! $VENV/bin/python -c "import transformers, sys; sys.exit(transformers.__version__ != '$OLDEST')" 2>/dev/null; then
    rm -rf $VENV
    .venv/bin/python -m venv $VENV
    base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    own=$($VENV/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$base" > "$own/zz-oases-base.pth"
    $VENV/bin/python -m pip install --quiet "transformers==$OLDEST"
fi
PYTHONPATH=python_api $VENV/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_models_matrix.py tests/test_gpt_oss.py tests/test_user_models.py tests/test_moe.py tests/test_parallelize.py \
    tests/test_pretrained.py tests/test_meta_build.py tests/test_input_checks.py
