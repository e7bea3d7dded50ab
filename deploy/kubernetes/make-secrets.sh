#!/usr/bin/env bash
# A dev CA and one certificate per instance (`sdcp certs`), printed as the Secrets the manifests
# mount: one Secret per identity (sdcp-<workload>, holding that identity's certificate and key
# only), sdcp-ca (the CA's certificate, never its key), sdcp-gateway-api-key (a new random key,
# or $SDCP_API_KEY), and Redis's users (`sdcp redis-acl`): sdcp-redis-acl (the ACL file Redis loads,
# passwords hashed) and sdcp-redis-<role> (the password of the router's, verifiers', drafters' and
# admin's user; each pod mounts its role's). Each pod mounts sdcp-ca and its own identity's Secret, so no pod holds a key
# with which it could pose as another instance. With your own CA, create the same Secrets from
# your files instead (docs/deploy.md).
#   deploy/kubernetes/make-secrets.sh [CERT_DIR] | kubectl apply -f -
# Adding an instance later (docs/deploy.md, "Adding instances"): name it, and only its Secret is
# printed, its certificate signed by the CA already in CERT_DIR; no other certificate changes.
#   deploy/kubernetes/make-secrets.sh CERT_DIR verifier-2 | kubectl apply -f -
set -euo pipefail
dir=${1:-sdcp-certs}
shift $(($# > 0 ? 1 : 0))
domain=sdcp.svc.cluster.local

# An identity's base URI, from its workload's name: the router and the gateway by their Service,
# verifier-N and drafter-N by their pod's name under the headless Service of their role.
uri_of() {
  case $1 in
    router) echo "https://router.$domain:8443" ;;
    gateway) echo "https://gateway.$domain:8000" ;;
    verifier-[0-9]* | drafter-[0-9]*) echo "https://$1.${1%-*}.$domain:8443" ;;
    *)
      echo "make-secrets.sh: no identity named $1 (router, gateway, verifier-N, drafter-N)" >&2
      exit 2
      ;;
  esac
}

if (($# > 0)); then
  identities=("$@")
  everything=false
else
  identities=(router verifier-0 verifier-1 drafter-0 drafter-1 gateway)
  everything=true
fi
uris=()
for name in "${identities[@]}"; do
  uris+=("$(uri_of "$name")")
done
# shellcheck disable=SC2046 # one --instance per URI, split on purpose
sdcp certs "$dir" $(printf -- '--instance %s ' "${uris[@]}") >&2

# A Secret of these files, the keys of its data their base names (kubectl's --from-file).
secret() {
  local name=$1 file
  shift
  printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: sdcp\n' "$name"
  printf '  labels: {app.kubernetes.io/name: sdcp}\ntype: Opaque\ndata:\n'
  for file in "$@"; do
    printf '  %s: %s\n' "${file##*/}" "$(base64 <"$file" | tr -d '\n')"
  done
  echo ---
}

# The files of an instance: <host>_<port>.pem and .key (sdcp.transport.certs.instance_name).
for index in "${!identities[@]}"; do
  stem=${uris[$index]#https://}
  stem=${stem/:/_}
  secret "sdcp-${identities[$index]}" "$dir/$stem.pem" "$dir/$stem.key"
done

if $everything; then
  secret sdcp-ca "$dir/ca.pem"
  scratch=$(umask 077 && mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  # 32 random bytes in hex, unless the caller chose the key.
  printf '%s\n' "${SDCP_API_KEY:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}" >"$scratch/api-key"
  secret sdcp-gateway-api-key "$scratch/api-key"
  # One Redis user per role, new random passwords (docs/security.md, "Store credentials per role").
  sdcp redis-acl --secrets "$scratch/redis" --acl-file "$scratch/users.acl" \
    --role router --role verifier --role drafter --role admin >/dev/null
  secret sdcp-redis-acl "$scratch/users.acl"
  for role in router verifier drafter admin; do
    cp "$scratch/redis/$role.password" "$scratch/password"
    secret "sdcp-redis-$role" "$scratch/password"
  done
  echo "the gateway's API key: kubectl -n sdcp get secret sdcp-gateway-api-key -o jsonpath='{.data.api-key}' | base64 -d" >&2
fi
