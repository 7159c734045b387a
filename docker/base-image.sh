#!/usr/bin/env bash
# Make a base image from Debian's packages, for a machine that reaches Debian's mirror but no
# image registry: mmdebstrap writes a minimal Debian root filesystem as a tarball and the
# container engine imports it as an image.
#
#   docker/base-image.sh python [IMAGE]   # Python 3 + venv: the images' PYTHON_IMAGE
#   docker/base-image.sh redis  [IMAGE]   # redis-server: the session store for docker/smoke.sh
#
# Defaults: IMAGE=localhost/specdec-base-python:bookworm or localhost/specdec-redis:bookworm.
# Environment: SPECDEC_ENGINE (docker or podman; default: the first whose daemon answers),
# SPECDEC_DEBIAN_SUITE (bookworm), SPECDEC_DEBIAN_MIRROR (http://deb.debian.org/debian),
# SPECDEC_EXTRA_CA_DIR (/usr/local/share/ca-certificates: this machine's own CA certificates,
# copied in so that pip and apt inside a build trust what this machine trusts, e.g. a proxy that
# inspects TLS; set it to an empty string to copy none).
# Needs root (mmdebstrap's root mode) and mmdebstrap (Debian package `mmdebstrap`).
set -euo pipefail

flavour=${1:-}
suite=${SPECDEC_DEBIAN_SUITE:-bookworm}
mirror=${SPECDEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${mirror%/debian}/debian-security
extra_ca_dir=${SPECDEC_EXTRA_CA_DIR-/usr/local/share/ca-certificates}

case "$flavour" in
  python)
    image=${2:-localhost/specdec-base-python:$suite}
    # python-is-python3: the Dockerfiles call `python`; passwd: they add a user
    packages=python3,python3-venv,python-is-python3,ca-certificates,passwd
    changes=(--change 'CMD ["python3"]')
    ;;
  redis)
    image=${2:-localhost/specdec-redis:$suite}
    packages=redis-server
    # no persistence, as docker/compose.yaml runs it; protected mode off: the containers'
    # network is the only way in
    changes=(--change 'USER redis' --change 'WORKDIR /var/lib/redis' --change 'EXPOSE 6379'
             --change 'CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]')
    ;;
  *)
    echo "usage: $0 python|redis [IMAGE]" >&2
    exit 2
    ;;
esac

engine=${SPECDEC_ENGINE:-}
if [[ -z "$engine" ]]; then
  for candidate in docker podman; do
    if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then
      engine=$candidate
      break
    fi
  done
fi
[[ -n "$engine" ]] || { echo "$0: no container engine answers (docker info, podman info)" >&2; exit 2; }
command -v mmdebstrap >/dev/null || { echo "$0: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

hooks=()
if [[ -n "$extra_ca_dir" ]] && compgen -G "$extra_ca_dir/*.crt" >/dev/null; then
  # only where the image has a trust store (ca-certificates) to add them to
  hooks+=(--customize-hook="if [ -d \"\$1/usr/local/share/ca-certificates\" ]; then cp $extra_ca_dir/*.crt \"\$1/usr/local/share/ca-certificates/\" && chroot \"\$1\" update-ca-certificates --fresh >/dev/null; fi")
fi

# minbase: Essential packages and apt only; no recommends, no documentation, man pages or
# translations (the dpkg filters stay in the image, so later apt-get installs skip them too)
mmdebstrap --variant=minbase --include="$packages" \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  "${hooks[@]}" \
  "$suite" "$work/rootfs.tar" \
  "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security_mirror $suite-security main"

"$engine" import --change 'ENV LANG=C.UTF-8' "${changes[@]}" "$work/rootfs.tar" "$image" >/dev/null
echo "$image"
