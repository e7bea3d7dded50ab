#!/usr/bin/env bash
# A dev CA and one certificate per instance (`sdcp certs`), printed as the Secrets the manifests
# mount. With your own CA, create the same Secrets from your files instead (docs/deploy.md).
#   deploy/kubernetes/make-secrets.sh [CERT_DIR] | kubectl apply -f -
set -euo pipefail
dir=${1:-sdcp-certs}
domain=sdcp.svc.cluster.local
router=https://router.$domain:8443
verifiers=(https://verifier-0.verifier.$domain:8443 https://verifier-1.verifier.$domain:8443)
drafters=(https://drafter-0.drafter.$domain:8443 https://drafter-1.drafter.$domain:8443)
gateway=https://gateway.$domain:8000

instances=("$router" "${verifiers[@]}" "${drafters[@]}" "$gateway")
sdcp certs "$dir" $(printf -- '--instance %s ' "${instances[@]}") >&2

# The files of an instance: <host>_<port>.pem and .key (sdcp.transport.certs.instance_name).
files() {
  local uri stem
  for uri in "$@"; do
    stem=${uri#https://}
    stem=${stem/:/_}
    printf -- '--from-file=%s/%s.pem --from-file=%s/%s.key ' "$dir" "$stem" "$dir" "$stem"
  done
}

secret() {
  local name=$1
  shift
  # shellcheck disable=SC2046
  kubectl create secret generic "$name" --namespace sdcp --dry-run=client -o yaml $(files "$@")
  echo ---
}

kubectl create secret generic sdcp-ca --namespace sdcp --dry-run=client -o yaml --from-file="$dir/ca.pem"
echo ---
secret sdcp-router "$router"
secret sdcp-verifier "${verifiers[@]}"
secret sdcp-drafter "${drafters[@]}"
secret sdcp-gateway "$gateway"
