//! The libpq password file (`~/.pgpass`, or `passfile`/`PGPASSFILE`): where a password comes
//! from when the connection string has none, read with libpq's rules for matching, escaping and
//! the file's permissions.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::settings::{DEFAULT_SOCKET_DIR, Endpoint, Host};

/// Looks the endpoint up in a libpq password file (`host:port:database:user:password`, `*`
/// matching anything, `\` escaping `:` and `\`). Like libpq, a file that others can read is
/// ignored with a warning, and the default socket directory matches the name `localhost`.
pub(super) fn password_from_file(
    path: &Path,
    endpoint: &Endpoint,
    dbname: &str,
    user: &str,
    warnings: &mut Vec<String>,
) -> Option<String> {
    let meta = fs::metadata(path).ok()?;
    if !meta.is_file() {
        warnings.push(format!(
            "password file {} is not a plain file; not using it",
            path.display()
        ));
        return None;
    }
    if meta.permissions().mode() & 0o077 != 0 {
        warnings.push(format!(
            "password file {} has group or world access; permissions should be u=rw (0600) or less; not using it",
            path.display()
        ));
        return None;
    }
    let contents = fs::read_to_string(path).ok()?;
    let host = match &endpoint.host {
        Host::Tcp(name) => name.clone(),
        Host::Socket(dir) if dir == Path::new(DEFAULT_SOCKET_DIR) => "localhost".to_owned(),
        Host::Socket(dir) => dir.display().to_string(),
    };
    let port = endpoint.port.to_string();
    let wanted = [host.as_str(), port.as_str(), dbname, user];
    contents
        .lines()
        .filter(|line| !line.trim_start().starts_with('#') && !line.trim().is_empty())
        .find_map(|line| {
            let fields = split_pgpass_line(line);
            if fields.len() < 5 {
                return None;
            }
            let matches = fields[..4]
                .iter()
                .zip(wanted)
                .all(|(field, want)| field == "*" || field == want);
            matches.then(|| fields[4..].join(":"))
        })
}

fn split_pgpass_line(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(escaped) = chars.next()
                    && let Some(field) = fields.last_mut()
                {
                    field.push(escaped);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            _ => {
                if let Some(field) = fields.last_mut() {
                    field.push(c);
                }
            }
        }
    }
    fields
}
