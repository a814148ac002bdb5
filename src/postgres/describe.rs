//! Driver errors in one line, the way every PostgreSQL message of pgleader's shows them: the
//! server's own message and SQLSTATE when there is one, else the chain of causes.

/// One line describing a driver error: the server's own message and SQLSTATE when there is
/// one, else the chain of causes.
pub fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        let mut line = format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
        if let Some(detail) = db.detail() {
            line.push_str(&format!("; {}", detail.replace('\n', " ")));
        }
        return line;
    }
    let mut line = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line.replace('\n', " ")
}
