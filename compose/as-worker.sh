#!/bin/sh
# Runs a command of the docker-compose.yml demo as the image's unprivileged `worker` user,
# with a folder it may write. Usage (as root): as-worker.sh DIR COMMAND [ARG...]
#
# DIR (under the mounted /results) is made and handed to `worker`; the command then runs
# with worker's uid, gid and groups (setpriv, util-linux: in the Debian minbase), no
# inheritable capabilities and no_new_privs, so it holds none of the container's root
# capabilities (NET_ADMIN included) and cannot gain any through a set-uid program.
set -eu
dir=$1
shift
install -d -o worker -g worker "$dir"
exec setpriv --reuid=worker --regid=worker --init-groups --inh-caps=-all --no-new-privs \
    env HOME=/home/worker USER=worker LOGNAME=worker "$@"
