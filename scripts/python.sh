# Sourced by the other scripts (not run): sets PYTHON to the interpreter pdserve is installed
# into, and VENV_NEEDED=1 when that is ./.venv and it does not exist yet (install.sh creates it).
#   - $PYTHON (default python3) when it runs inside a virtual environment already;
#   - else ./.venv/bin/python when ./.venv exists;
#   - else $PYTHON itself, unless pip would refuse to install into it: a distribution's
#     "externally managed" Python (PEP 668; Debian's and Ubuntu's python3), whose packages
#     belong to apt. Then ./.venv, made from it.
# BASE_PYTHON keeps the interpreter a new ./.venv is made from.
BASE_PYTHON=${PYTHON:-python3}
VENV_NEEDED=0
if ! command -v "$BASE_PYTHON" >/dev/null 2>&1; then
  echo "pdserve: no $BASE_PYTHON on PATH; install Python 3.11+ (Debian/Ubuntu: apt install python3 python3-venv) or set PYTHON" >&2
  exit 1
fi
_pdserve_where=$("$BASE_PYTHON" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
managed = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
print("venv" if in_venv else "managed" if managed else "plain")
PY
)
if [ "$_pdserve_where" = venv ]; then
  PYTHON=$BASE_PYTHON
elif [ -x .venv/bin/python ]; then
  PYTHON=.venv/bin/python
elif [ "$_pdserve_where" = managed ]; then
  PYTHON=.venv/bin/python
  VENV_NEEDED=1
else
  PYTHON=$BASE_PYTHON
fi
unset _pdserve_where
