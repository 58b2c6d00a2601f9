# Shared by the peer setup scripts (source it): a peer's own venv, outside the repo tree.
#
#   peer_venv_begin NAME VENV   exits 0 at once if VENV is finished; else creates it ($PYTHON) with a
#                               current pip
#   peer_venv_done NAME VENV    marks VENV finished, so the next run leaves it as it is

peer_venv_begin() {
    local name="$1" venv="$2"
    if [[ -f "$venv/.installed" ]]; then
        echo "$name venv ready: $venv"
        exit 0
    fi
    test -x "$venv/bin/python" || "${PYTHON:-python3.11}" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
}

peer_venv_done() {
    local name="$1" venv="$2"
    touch "$venv/.installed"
    echo "$name venv ready: $venv"
}
