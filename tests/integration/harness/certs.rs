//! Certificates the tests make: a CA of their own, for the servers that speak TLS to pgleader
//! (PostgreSQL, Redis, a ping's monitor).

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// A self-signed CA: its certificate in PEM, and what signs with it.
pub fn authority(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).expect("self-sign the CA");
    (cert.pem(), Issuer::new(params, key))
}
