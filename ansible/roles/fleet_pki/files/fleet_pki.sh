#!/usr/bin/env bash
# The fleet CA on the controller: DIR/ca.crt (public), DIR/ca.key.vault and DIR/<name>.key.vault
# (Ansible Vault), DIR/<name>.crt signed by the CA with the given subjectAltNames. Creates the
# CA when missing; issues a certificate when it is missing, expires within RENEW days, or its
# names changed. Prints "issued <what>" for each. Keys never touch the disk in the clear but
# in a private temporary directory removed on exit.
#   fleet_pki.sh DIR VAULT_PASSWORD_FILE ANSIBLE_VAULT CA_NAME CA_DAYS CERT_DAYS RENEW name=SAN,SAN ...
set -euo pipefail
DIR=$1 PASS=$2 VAULT=$3 CA_NAME=$4 CA_DAYS=$5 CERT_DAYS=$6 RENEW=$7
shift 7
umask 077
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# The password file given, and no other vault id (ANSIBLE_VAULT_PASSWORD_FILE would add a second).
vault() { env -u ANSIBLE_VAULT_PASSWORD_FILE -u ANSIBLE_VAULT_IDENTITY_LIST "$VAULT" "$@" --vault-password-file "$PASS"; }
encrypt() { vault encrypt --output "$2" "$1" >/dev/null; }
if [ ! -f "$DIR/ca.crt" ] || [ ! -f "$DIR/ca.key.vault" ]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$TMP/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$TMP/ca.key" -sha256 -days "$CA_DAYS" -subj "/CN=$CA_NAME" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$TMP/ca.crt"
  encrypt "$TMP/ca.key" "$TMP/ca.key.vault"
  install -m 600 "$TMP/ca.key.vault" "$DIR/ca.key.vault"
  install -m 644 "$TMP/ca.crt" "$DIR/ca.crt"
  rm -f "$DIR"/*.crt.sans
  echo "issued CA $CA_NAME"
fi
ca_key_ready=0
for request in "$@"; do
  name=${request%%=*} sans=${request#*=}
  crt=$DIR/$name.crt
  if [ -f "$crt" ] && [ -f "$DIR/$name.key.vault" ] && [ "$(cat "$crt.sans" 2>/dev/null)" = "$sans" ] \
     && openssl x509 -in "$crt" -noout -checkend $(( RENEW * 86400 )) >/dev/null \
     && openssl verify -CAfile "$DIR/ca.crt" "$crt" >/dev/null 2>&1; then
    continue
  fi
  if [ "$ca_key_ready" = 0 ]; then
    vault decrypt --output "$TMP/ca.key" "$DIR/ca.key.vault" >/dev/null
    ca_key_ready=1
  fi
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$TMP/$name.key" 2>/dev/null
  openssl req -new -key "$TMP/$name.key" -subj "/CN=$name" -out "$TMP/$name.csr"
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
    "$sans" > "$TMP/$name.ext"
  openssl x509 -req -in "$TMP/$name.csr" -CA "$DIR/ca.crt" -CAkey "$TMP/ca.key" -CAcreateserial \
    -CAserial "$TMP/ca.srl" -sha256 -days "$CERT_DAYS" -extfile "$TMP/$name.ext" -out "$TMP/$name.crt" 2>/dev/null
  encrypt "$TMP/$name.key" "$TMP/$name.key.vault"
  install -m 600 "$TMP/$name.key.vault" "$DIR/$name.key.vault"
  install -m 644 "$TMP/$name.crt" "$crt"
  printf '%s' "$sans" > "$crt.sans"
  echo "issued $name ($sans)"
done
