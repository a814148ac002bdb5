//! TLS for the connection to PostgreSQL, through rustls (no OpenSSL at build or run time), with
//! libpq's `sslmode` rules:
//!
//! | sslmode | TLS | the server's certificate |
//! |---|---|---|
//! | disable | never | |
//! | allow, prefer | if the server offers it; without TLS if the handshake fails | checked as verify-ca if a root certificate file exists, else not |
//! | require | always | as for prefer (libpq keeps this for compatibility) |
//! | verify-ca | always | signed by a CA from `sslrootcert` |
//! | verify-full | always | signed by a CA from `sslrootcert`, and issued for the host name |
//!
//! `sslrootcert=system` trusts the system's store (read with rustls-native-certs). As in libpq,
//! TLS is never used over Unix sockets. The files are read again on each connection attempt,
//! so a renewed certificate is picked up at the next reconnection without a restart.
//!
//! tokio-postgres-rustls adapts rustls to the driver (with `tls-server-end-point` channel
//! binding for SCRAM); what this module adds is the policy: which certificates to trust, how
//! much of them to check, and errors that say what is wrong, sorted into permanent (a retry
//! cannot fix a certificate) and transient.

use std::fmt;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    AlertDescription, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore,
    SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;
use tracing::warn;

use crate::election::ConnectError;
use crate::postgres::conninfo::{SslMode, TlsSettings};

/// The driver's connector: rustls under tokio-postgres.
pub type Connector = MakeRustlsConnect;

/// How much of the server's certificate to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Check {
    /// Encryption only: any certificate is accepted (handshake signatures are still checked).
    Nothing,
    /// The chain must lead to a trusted CA; the host name is not compared (verify-ca).
    Chain,
    /// The chain and the host name (verify-full).
    ChainAndName,
}

/// The sslmode to give the driver for one connection. The driver would send its TLS request
/// over a Unix socket too, where the server always declines, so `require` would fail; libpq
/// ignores sslmode on Unix sockets, and so does pgleader.
pub fn driver_mode(
    settings: &TlsSettings,
    over_unix_socket: bool,
) -> tokio_postgres::config::SslMode {
    use tokio_postgres::config::SslMode as Driver;
    match settings.mode {
        _ if over_unix_socket => Driver::Disable,
        SslMode::Disable => Driver::Disable,
        // The driver has no "allow" (plaintext first, TLS if the server insists); TLS first
        // with a fallback reaches a server either way.
        SslMode::Allow | SslMode::Prefer => Driver::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Driver::Require,
    }
}

/// Builds the connector for one connection attempt from the settings and the files they name.
/// An error here is permanent: a missing or unreadable certificate file.
pub fn connector(settings: &TlsSettings) -> Result<Connector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let check = check_for(settings);
    let chain = match check {
        Check::Nothing => None,
        Check::Chain | Check::ChainAndName => Some(
            WebPkiServerVerifier::builder_with_provider(trusted_roots(settings)?, provider.clone())
                .build()
                .map_err(|err| format!("cannot use the root certificates: {err}"))?,
        ),
    };
    let verifier = Arc::new(Verifier {
        chain,
        check_name: check == Check::ChainAndName,
        algorithms: provider.signature_verification_algorithms,
    });
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("cannot set up TLS: {err}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match client_certificate(settings)? {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|err| format!("cannot use the client certificate: {err}"))?,
        None => builder.with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(config))
}

/// Whether to try the same server again without TLS: under `sslmode=prefer` or `allow`, a
/// failed TLS handshake is followed by one attempt without TLS, as libpq does. Says so in the
/// log when it is.
pub fn falls_back_to_plaintext(err: &tokio_postgres::Error, settings: &TlsSettings) -> bool {
    let Some(tls) =
        rustls_error(err).filter(|_| matches!(settings.mode, SslMode::Allow | SslMode::Prefer))
    else {
        return false;
    };
    warn!(
        event = "tls_fallback",
        reason = %describe_rustls(tls, settings),
        "the TLS handshake failed; connecting without TLS (sslmode={})",
        settings.mode.as_str()
    );
    true
}

/// Sorts a connection error that has to do with TLS, with a message that says what is wrong.
/// `None` for errors that have nothing to do with TLS.
pub fn classify(err: &tokio_postgres::Error, settings: &TlsSettings) -> Option<ConnectError> {
    if let Some(tls) = rustls_error(err) {
        let message = describe_rustls(tls, settings);
        return Some(if is_permanent(tls) {
            ConnectError::Permanent(message)
        } else {
            ConnectError::Transient(message)
        });
    }
    let source = std::error::Error::source(err).map(ToString::to_string);
    if source.as_deref() == Some("server does not support TLS") {
        return Some(ConnectError::Permanent(format!(
            "the server does not accept TLS connections, and sslmode={} insists on TLS (turn \
             ssl on in the server, or use sslmode=prefer)",
            settings.mode.as_str()
        )));
    }
    // pg_hba.conf has only `hostssl` lines for this client: say what to change.
    let db = err.as_db_error()?;
    if db.code().code().starts_with("28") && db.message().ends_with("no encryption") {
        return Some(ConnectError::Permanent(format!(
            "{}: {} (SQLSTATE {}); the server accepts this client only over TLS: use \
             sslmode=require or stronger",
            db.severity(),
            db.message(),
            db.code().code()
        )));
    }
    None
}

/// The rustls error behind a failed handshake, if that is what failed. tokio-rustls wraps it in
/// an `io::Error`, which hides it from `source()`; `get_ref` still reaches it.
fn rustls_error(err: &tokio_postgres::Error) -> Option<&rustls::Error> {
    let source = std::error::Error::source(err)?;
    source
        .downcast_ref::<io::Error>()?
        .get_ref()?
        .downcast_ref::<rustls::Error>()
}

/// A certificate the server shows, an alert it sends, or a protocol it lacks stays so until
/// someone changes a configuration: retrying would only fill the log.
fn is_permanent(err: &rustls::Error) -> bool {
    matches!(
        err,
        rustls::Error::InvalidCertificate(_)
            | rustls::Error::AlertReceived(_)
            | rustls::Error::PeerIncompatible(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::UnsupportedNameType
    )
}

fn describe_rustls(err: &rustls::Error, settings: &TlsSettings) -> String {
    match err {
        rustls::Error::InvalidCertificate(cert) => {
            format!(
                "certificate verify failed: {}",
                describe_certificate(cert, settings)
            )
        }
        rustls::Error::AlertReceived(alert) => {
            let why = match alert {
                AlertDescription::CertificateRequired => {
                    " (it wants a client certificate: set sslcert and sslkey)"
                }
                AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateExpired
                | AlertDescription::CertificateRevoked
                | AlertDescription::CertificateUnknown
                | AlertDescription::UnsupportedCertificate => {
                    " (it does not accept the client certificate)"
                }
                _ => "",
            };
            format!("the server ended the TLS handshake: {alert:?}{why}")
        }
        rustls::Error::PeerIncompatible(what) => format!(
            "the server and pgleader have no TLS version or algorithm in common ({what:?}); \
             pgleader speaks TLS 1.2 and 1.3"
        ),
        other => format!("the TLS handshake failed: {other}"),
    }
}

fn describe_certificate(err: &CertificateError, settings: &TlsSettings) -> String {
    match err {
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "hostname mismatch: the server's certificate is for {}, not for \"{}\" \
             (sslmode=verify-full checks the host name)",
            names(presented),
            expected.to_str()
        ),
        CertificateError::NotValidForName => {
            "hostname mismatch: the server's certificate is not for this host name \
             (sslmode=verify-full checks the host name)"
                .to_owned()
        }
        CertificateError::UnknownIssuer => format!(
            "the server's certificate is not signed by a trusted CA (trusted: {})",
            TrustedRoots(settings)
        ),
        CertificateError::BadSignature => format!(
            "a signature in the server's certificate chain does not verify (trusted: {})",
            TrustedRoots(settings)
        ),
        CertificateError::ExpiredContext { not_after, .. } => format!(
            "the server's certificate expired at {}",
            rfc3339(*not_after)
        ),
        CertificateError::Expired => "the server's certificate has expired".to_owned(),
        CertificateError::NotValidYetContext { not_before, .. } => format!(
            "the server's certificate is not valid before {}",
            rfc3339(*not_before)
        ),
        CertificateError::NotValidYet => "the server's certificate is not valid yet".to_owned(),
        other => format!("{other}"),
    }
}

/// The names a certificate is for, as rustls presents them (`DnsName("db")`,
/// `IpAddress(10.0.0.5)`), the way people write them: `"db", 10.0.0.5`.
fn names(presented: &[String]) -> String {
    if presented.is_empty() {
        return "no host name".to_owned();
    }
    presented
        .iter()
        .map(|name| {
            let inner = |prefix: &str| {
                name.strip_prefix(prefix)
                    .and_then(|rest| rest.strip_suffix(')'))
            };
            if let Some(dns) = inner("DnsName(") {
                dns.to_owned()
            } else if let Some(ip) = inner("IpAddress(") {
                ip.to_owned()
            } else {
                format!("{name:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn rfc3339(time: UnixTime) -> String {
    crate::time::rfc3339_seconds(
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(time.as_secs()),
    )
}

/// Where trust comes from, for messages: the file or the system's store.
struct TrustedRoots<'a>(&'a TlsSettings);

impl fmt::Display for TrustedRoots<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.root_cert {
            _ if self.0.uses_system_roots() => f.write_str("the system's certificate store"),
            Some(path) => write!(f, "sslrootcert {}", path.display()),
            None => f.write_str("no root certificate"),
        }
    }
}

fn check_for(settings: &TlsSettings) -> Check {
    let root_exists =
        settings.uses_system_roots() || settings.root_cert.as_deref().is_some_and(Path::exists);
    match settings.mode {
        SslMode::VerifyFull => Check::ChainAndName,
        SslMode::VerifyCa => Check::Chain,
        // libpq: "if a root CA file exists, the behavior of sslmode=require will be the same
        // as that of verify-ca" (and likewise for prefer and allow).
        SslMode::Disable | SslMode::Allow | SslMode::Prefer | SslMode::Require => {
            if root_exists {
                Check::Chain
            } else {
                Check::Nothing
            }
        }
    }
}

fn trusted_roots(settings: &TlsSettings) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    if settings.uses_system_roots() {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            let errors = found
                .errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            return Err(format!(
                "sslrootcert=system: no certificate found in the system's certificate store \
                 (install the ca-certificates package, or point SSL_CERT_FILE at a bundle){}",
                if errors.is_empty() {
                    String::new()
                } else {
                    format!(": {errors}")
                }
            ));
        }
        return Ok(Arc::new(roots));
    }
    let Some(path) = settings.root_cert.as_deref().filter(|path| path.exists()) else {
        let shown = settings.root_cert.as_deref().map_or_else(
            || "~/.postgresql/root.crt".to_owned(),
            |p| p.display().to_string(),
        );
        return Err(format!(
            "root certificate file \"{shown}\" does not exist; sslmode={} needs one to check \
             the server's certificate. Give it with sslrootcert (or PGSSLROOTCERT), use the \
             system's trusted roots with sslrootcert=system, or use sslmode=require to \
             encrypt without checking",
            settings.mode.as_str()
        ));
    };
    let certs = read_certificates(path, "root certificate")?;
    for cert in certs {
        roots.add(cert).map_err(|err| {
            format!(
                "cannot use a certificate in root certificate file {}: {err}",
                path.display()
            )
        })?;
    }
    Ok(Arc::new(roots))
}

fn read_certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|err| format!("cannot read {what} file {}: {err}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} file {} holds no PEM certificate",
            path.display()
        ));
    }
    Ok(certs)
}

type ClientIdentity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// The client certificate and key, if a certificate file exists (libpq sends none otherwise).
fn client_certificate(settings: &TlsSettings) -> Result<Option<ClientIdentity>, String> {
    let Some(cert_path) = settings.client_cert.as_deref().filter(|path| path.exists()) else {
        return Ok(None);
    };
    let chain = read_certificates(cert_path, "client certificate")?;
    let key_path = settings
        .client_key
        .as_deref()
        .filter(|path| path.exists())
        .ok_or_else(|| {
            format!(
                "client certificate {} is present, but not its private key file{}",
                cert_path.display(),
                settings
                    .client_key
                    .as_deref()
                    .map(|path| format!(" {}", path.display()))
                    .unwrap_or_default()
            )
        })?;
    check_key_permissions(key_path)?;
    let key = PrivateKeyDer::from_pem_file(key_path).map_err(|err| {
        format!(
            "cannot read private key file {} (an unencrypted PEM key is needed): {err}",
            key_path.display()
        )
    })?;
    Ok(Some((chain, key)))
}

/// libpq's rule: a key file others can read is refused.
fn check_key_permissions(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path)
        .map_err(|err| format!("cannot read private key file {}: {err}", path.display()))?;
    let mode = meta.mode();
    let too_open = if meta.uid() == 0 {
        mode & 0o037 != 0
    } else {
        mode & 0o077 != 0
    };
    if too_open {
        return Err(format!(
            "private key file {} has group or world access; it must have permissions u=rw \
             (0600) or less if owned by the current user, or u=rw,g=r (0640) or less if owned \
             by root",
            path.display()
        ));
    }
    Ok(())
}

/// The check of the server's certificate that the sslmode asks for. Handshake signatures are
/// always checked against the certificate's key, even when the certificate itself is not: it
/// costs nothing and keeps the handshake honest.
#[derive(Debug)]
struct Verifier {
    /// `None`: any certificate (require without a root certificate: encryption against
    /// eavesdroppers, no authentication of the server, as in libpq).
    chain: Option<Arc<WebPkiServerVerifier>>,
    /// False for verify-ca: any name will do. webpki checks the chain (and the validity period)
    /// before the name, so a name mismatch is the only error that may be set aside.
    check_name: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn settings(mode: SslMode, root: Option<&str>) -> TlsSettings {
        TlsSettings {
            mode,
            root_cert: root.map(PathBuf::from),
            client_cert: None,
            client_key: None,
        }
    }

    #[test]
    fn require_checks_the_chain_only_when_a_root_certificate_exists() {
        assert_eq!(
            check_for(&settings(SslMode::Require, Some("/no/such/root.crt"))),
            Check::Nothing
        );
        assert_eq!(check_for(&settings(SslMode::Require, None)), Check::Nothing);
        // Any file that exists will do for the rule.
        assert_eq!(
            check_for(&settings(SslMode::Require, Some("/etc/hostname"))),
            Check::Chain
        );
        assert_eq!(
            check_for(&settings(SslMode::Prefer, Some("/etc/hostname"))),
            Check::Chain
        );
        assert_eq!(check_for(&settings(SslMode::VerifyCa, None)), Check::Chain);
        assert_eq!(
            check_for(&settings(SslMode::VerifyFull, Some("system"))),
            Check::ChainAndName
        );
    }

    #[test]
    fn verify_modes_without_a_root_certificate_say_what_to_do() {
        let Err(err) = connector(&settings(SslMode::VerifyFull, Some("/no/such/root.crt"))) else {
            panic!("a connector without a root certificate");
        };
        assert!(
            err.contains("\"/no/such/root.crt\" does not exist"),
            "{err}"
        );
        assert!(err.contains("sslrootcert=system"), "{err}");
    }

    #[test]
    fn certificate_names_read_as_people_write_them() {
        let presented = [
            "DnsName(\"db.example\")".to_owned(),
            "IpAddress(10.0.0.5)".to_owned(),
        ];
        assert_eq!(names(&presented), "\"db.example\", 10.0.0.5");
        assert_eq!(names(&[]), "no host name");
    }

    #[test]
    fn require_without_a_root_certificate_builds_a_connector() {
        assert!(connector(&settings(SslMode::Require, None)).is_ok());
    }

    #[test]
    fn a_key_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("pgleader-key-{}", std::process::id()));
        std::fs::write(&path, "not a key").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = check_key_permissions(&path).expect_err("too open");
        assert!(err.contains("group or world access"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(check_key_permissions(&path).is_ok());
        std::fs::remove_file(&path).ok();
    }
}
