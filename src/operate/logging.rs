//! Logs: one line per event on stderr, as text for people or as JSON for log pipelines.
//!
//! Every event carries a short machine-readable `event` name ("leader", "child_exited", ...)
//! beside its message, plus the fields that matter for it (`lock`, `pid`, `backend_pid`,
//! `reason`, `status`, `exit_code`). The JSON form is one object per line with `time`, `level`,
//! `event`, `message` and those fields at the top level; these names are a stable interface.
//!
//! Nothing logged ever contains a password: connection settings are logged through their
//! redacting `Display`.

use std::fmt;
use std::io;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::cli::LogFormat;

/// How this process logs, once [`init`] has run: the keeper logs the same way.
static CURRENT: std::sync::OnceLock<(LogFormat, i8)> = std::sync::OnceLock::new();

/// The format and verbosity [`init`] was given.
pub fn current() -> Option<(LogFormat, i8)> {
    CURRENT.get().copied()
}

/// Installs the global logger. `verbosity` is -q (negative) to -v (positive).
pub fn init(format: LogFormat, verbosity: i8) {
    let _ = CURRENT.set((format, verbosity));
    let level = match verbosity {
        i8::MIN..=-2 => Level::ERROR,
        -1 => Level::WARN,
        0 => Level::INFO,
        1 => Level::DEBUG,
        _ => Level::TRACE,
    };
    // A log reader that went away (`2>&1 | head`) is no reason to die: without this, the
    // subscriber reports the failed write with eprintln!, which panics on the same closed pipe,
    // and pgleader would exit 101 with its command orphaned to the keeper's cleanup.
    let builder = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(io::stderr)
        .log_internal_errors(false)
        .with_ansi(false);
    let result = match format {
        LogFormat::Text => builder.event_format(TextFormat).try_init(),
        LogFormat::Json => builder.event_format(JsonFormat).try_init(),
    };
    // A second initialisation (tests in one process) keeps the first logger.
    drop(result);
}

/// Collects an event's fields in order.
#[derive(Default)]
struct Fields {
    message: String,
    values: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.values
                .push((field.name(), Value::String(format!("{value:?}"))));
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            self.values
                .push((field.name(), Value::String(value.to_owned())));
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.values.push((field.name(), Value::from(value)));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.values.push((field.name(), Value::from(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.values.push((field.name(), Value::from(value)));
    }
}

fn collect(event: &Event<'_>) -> Fields {
    let mut fields = Fields::default();
    event.record(&mut fields);
    fields
}

fn now() -> String {
    crate::time::rfc3339_millis(jiff::Timestamp::now())
}

/// `2026-11-21T07:44:00.123Z INFO  became leader lock=10 backend_pid=4242`
struct TextFormat;

impl<S, N> FormatEvent<S, N> for TextFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let fields = collect(event);
        write!(
            writer,
            "{} {:<5} {}",
            now(),
            event.metadata().level(),
            fields.message
        )?;
        for (name, value) in &fields.values {
            if *name == "event" {
                continue;
            }
            match value {
                Value::String(text) if needs_quotes(text) => write!(writer, " {name}={text:?}")?,
                Value::String(text) => write!(writer, " {name}={text}")?,
                other => write!(writer, " {name}={other}")?,
            }
        }
        writeln!(writer)
    }
}

/// Whether a field's value is written quoted in the text format.
pub fn needs_quotes(text: &str) -> bool {
    text.is_empty()
        || text
            .chars()
            .any(|c| c.is_whitespace() || c == '"' || c == '=')
}

/// `{"time":"…","level":"info","event":"leader","message":"became leader","lock":"10",…}`
struct JsonFormat;

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let fields = collect(event);
        let mut object = Map::new();
        object.insert("time".into(), Value::String(now()));
        object.insert(
            "level".into(),
            Value::String(event.metadata().level().as_str().to_ascii_lowercase()),
        );
        for (name, value) in fields.values.iter().filter(|(name, _)| *name == "event") {
            object.insert((*name).into(), value.clone());
        }
        object.insert("message".into(), Value::String(fields.message));
        for (name, value) in fields
            .values
            .into_iter()
            .filter(|(name, _)| *name != "event")
        {
            object.insert(name.into(), value);
        }
        let line = serde_json::to_string(&Value::Object(object)).map_err(|_| fmt::Error)?;
        writeln!(writer, "{line}")
    }
}
