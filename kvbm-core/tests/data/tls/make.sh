#!/usr/bin/env bash
# Makes the shared tier's TLS test certificates (valid 100 years): a CA, a server certificate
# for 127.0.0.1 and localhost (also a client certificate: a cluster's nodes show it to each
# other on the bus), a client certificate, and another CA that signed neither. The CAs' keys
# are thrown away. Run in this directory; the tests use the files as committed.
set -euo pipefail
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() {
    key "$1.key"
    openssl req -x509 -new -key "$1.key" -sha256 -days 36500 -subj "/CN=$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$1.pem"
}
leaf() {
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=kvbm test $1" -out "$1.csr"
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature" "$2" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 36500 \
        -sha256 -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    rm "$1.csr" "$1.ext"
}
ca ca "kvbm test CA"
ca other-ca "kvbm test other CA"
leaf server "extendedKeyUsage=serverAuth,clientAuth
subjectAltName=IP:127.0.0.1,DNS:localhost"
leaf client "extendedKeyUsage=clientAuth"
rm -f ca.key other-ca.key ca.srl
