//! The daemon's text log, when its standard error is neither the journal nor a terminal: the
//! line tracing-subscriber's default format writes without colours, byte for byte, written
//! without the colour machinery and with the timestamp's digits written by hand.
//!
//! Every call ends in one such line (`call_log`). Through the default format a line took about
//! 8,300 instructions, of which styles that write nothing (its colours, switched off) and the
//! timestamp's formatting were about 5,000 (docs/performance.md, section 1, "The fifth pass").
//! A field is written as `name=value` directly; a message, an error or a raw identifier goes
//! through tracing-subscriber's own visitor, which escapes a message's control characters. Like
//! the default format, this one escapes no other field: what a client sent is made printable
//! before it is logged (`refusal_log::printable`).

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_log::NormalizeEvent;
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// The subscriber of the daemon's plain text log: `filter`'s events, one [`PlainLine`] each,
/// to `writer`. The bench installs the same, writing to nowhere.
pub fn plain_subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    writer: W,
) -> impl Subscriber + Send + Sync + 'static
where
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .fmt_fields(PlainFields)
        .event_format(PlainLine)
        .finish()
}

/// One event as `2026-12-08T00:35:00.123456Z  INFO target: message field=value`, with the
/// names and fields of the spans it is in before the target, as the default format writes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainLine;

impl<S, N> FormatEvent<S, N> for PlainLine
where
    S: Subscriber + for<'lookup> LookupSpan<'lookup>,
    N: for<'fields> FormatFields<'fields> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // A record of the `log` crate (a dependency's) carries its own target and level.
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let mut stamp = [0u8; STAMP_LEN];
        match rfc3339_micros(SystemTime::now(), &mut stamp) {
            Some(text) => writer.write_str(text)?,
            // Before 1970 or after 9999: the default format's own clock writes it.
            None => {
                if tracing_subscriber::fmt::time::SystemTime
                    .format_time(&mut writer)
                    .is_err()
                {
                    writer.write_str("<unknown time>")?;
                }
            }
        }
        writer.write_str(match *meta.level() {
            Level::TRACE => " TRACE ",
            Level::DEBUG => " DEBUG ",
            Level::INFO => "  INFO ",
            Level::WARN => "  WARN ",
            Level::ERROR => " ERROR ",
        })?;
        if let Some(scope) = ctx.event_scope() {
            let mut seen = false;
            for span in scope.from_root() {
                writer.write_str(span.metadata().name())?;
                seen = true;
                let extensions = span.extensions();
                if let Some(fields) = extensions.get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, "{{{fields}}}")?;
                }
                writer.write_char(':')?;
            }
            if seen {
                writer.write_char(' ')?;
            }
        }
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        ctx.format_fields(writer.by_ref(), event)?;
        writer.write_char('\n')
    }
}

/// An event's or a span's fields as the default format's `DefaultFields` writes them without
/// colours: `name=value` separated by spaces, the message first as it comes.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainFields;

impl<'writer> MakeVisitor<Writer<'writer>> for PlainFields {
    type Visitor = PlainVisitor<'writer>;

    fn make_visitor(&self, target: Writer<'writer>) -> PlainVisitor<'writer> {
        PlainVisitor {
            writer: target,
            is_empty: true,
            result: Ok(()),
        }
    }
}

/// Writes the fields of one event or span; see [`PlainFields`].
#[derive(Debug)]
pub struct PlainVisitor<'writer> {
    writer: Writer<'writer>,
    /// Nothing written yet: no space before the next field.
    is_empty: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// A field the default visitor writes with more than its name and value (an escaped
    /// message, an error and its sources, a raw identifier): written by that visitor.
    fn by_default_visitor(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        let mut visitor = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut visitor);
        self.is_empty = false;
        self.result = visitor.finish();
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        // The `log` crate's metadata, already in the line's target and level.
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        self.by_default_visitor(|visitor| visitor.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        if name == "message" || name.starts_with("r#") {
            self.by_default_visitor(|visitor| visitor.record_debug(field, value));
            return;
        }
        let separator = if std::mem::take(&mut self.is_empty) {
            ""
        } else {
            " "
        };
        self.result = (|| {
            self.writer.write_str(separator)?;
            self.writer.write_str(name)?;
            self.writer.write_char('=')?;
            write!(self.writer, "{value:?}")
        })();
    }
}

impl VisitOutput<fmt::Result> for PlainVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

/// `YYYY-MM-DDThh:mm:ss.uuuuuuZ`.
const STAMP_LEN: usize = 27;

/// `time` in UTC as the default format writes it, into `buffer`; `None` outside the years
/// 1970 to 9999, which that format writes otherwise. The date is the `time` crate's; only the
/// digits are written here, without the formatting machinery.
fn rfc3339_micros(time: SystemTime, buffer: &mut [u8; STAMP_LEN]) -> Option<&str> {
    let since_epoch = time.duration_since(UNIX_EPOCH).ok()?;
    let utc = time::OffsetDateTime::from_unix_timestamp(i64::try_from(since_epoch.as_secs()).ok()?)
        .ok()?;
    let year = u64::try_from(utc.year())
        .ok()
        .filter(|year| *year <= 9999)?;
    let fields: [(usize, u64, usize); 7] = [
        (0, year, 4),
        (5, u64::from(u8::from(utc.month())), 2),
        (8, u64::from(utc.day()), 2),
        (11, u64::from(utc.hour()), 2),
        (14, u64::from(utc.minute()), 2),
        (17, u64::from(utc.second()), 2),
        (20, u64::from(since_epoch.subsec_micros()), 6),
    ];
    *buffer = *b"0000-00-00T00:00:00.000000Z";
    for (start, mut value, width) in fields {
        for place in buffer.get_mut(start..start + width)?.iter_mut().rev() {
            // A digit: `value % 10` is below 10.
            *place = b'0' + u8::try_from(value % 10).ok()?;
            value /= 10;
        }
    }
    std::str::from_utf8(buffer).ok()
}

/// A writer for tests: what a subscriber wrote, shared with the test.
#[cfg(test)]
pub(crate) mod capture {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::MakeWriter;

    #[derive(Clone, Default)]
    pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'writer> MakeWriter<'writer> for Captured {
        type Writer = Captured;
        fn make_writer(&'writer self) -> Captured {
            self.clone()
        }
    }

    impl Captured {
        pub(crate) fn lines(&self) -> Vec<String> {
            String::from_utf8(self.0.lock().unwrap().clone())
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::capture::Captured;
    use super::*;
    use std::time::Duration;

    /// The events of the daemon's lines, in spans, and an escape sequence (each format writes it
    /// as it is).
    fn emit() {
        tracing::info!(
            rpc = "Hello",
            id = "run r1",
            from = "192.0.2.7",
            ms = 3_u64,
            "ok"
        );
        tracing::warn!(rpc = "BeginRun", code = ?tonic::Code::InvalidArgument, reason = %"bad\x1b[31m", "refused");
        tracing::error!("check found {} problem(s)", 2);
        let error = Outer(std::io::Error::other("disk \x1b[2J gone"));
        tracing::warn!(
            error = &error as &(dyn std::error::Error + 'static),
            r#type = "raw",
            log.target = "skipped",
            flag = true,
            count = -3_i64,
            "escaped \x1b[2J message"
        );
        tracing::info!(first = 1_u64, "");
        tracing::info!(only = "fields");
        let outer = tracing::info_span!("serve", node = "pve1");
        let _outer = outer.enter();
        let empty = tracing::info_span!("empty");
        let _empty = empty.enter();
        tracing::info!(peer = "operator alice", "streaming");
        tracing::debug!("not at info");
    }

    /// An error with a source, which the default visitor lists after it.
    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("reading the journal")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn lines_of<S>(subscriber: S, captured: &Captured) -> Vec<String>
    where
        S: Subscriber + Send + Sync + 'static,
    {
        tracing::subscriber::with_default(subscriber, emit);
        captured.lines()
    }

    /// The same bytes as the default format without colours, but for the instant of each line.
    #[test]
    fn a_line_is_the_default_formats_without_colours() {
        let plain = Captured::default();
        let default = Captured::default();
        let ours = lines_of(
            plain_subscriber(tracing_subscriber::EnvFilter::new("info"), plain.clone()),
            &plain,
        );
        let theirs = lines_of(
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
                .with_writer(default.clone())
                .with_ansi(false)
                .finish(),
            &default,
        );
        assert_eq!(ours.len(), 7, "{ours:#?}");
        assert_eq!(ours.len(), theirs.len(), "{ours:#?}\n{theirs:#?}");
        for (our, their) in ours.iter().zip(&theirs) {
            let (our_stamp, our_rest) = our.split_at(STAMP_LEN);
            let (their_stamp, their_rest) = their.split_at(STAMP_LEN);
            assert_eq!(our_rest, their_rest);
            // Both instants are now: the same form, and within the test's run of each other.
            let gap = (parse_stamp(our_stamp) - parse_stamp(their_stamp)).abs();
            assert!(
                gap < time::Duration::minutes(5),
                "{our_stamp} vs {their_stamp}"
            );
        }
        assert!(
            ours.iter()
                .any(|line| line.contains("serve{node=\"pve1\"}:empty: "))
        );
    }

    /// `YYYY-MM-DDThh:mm:ss.uuuuuuZ` as an instant.
    fn parse_stamp(stamp: &str) -> time::OffsetDateTime {
        let number = |range: std::ops::Range<usize>| -> u32 { stamp[range].parse().unwrap() };
        assert_eq!(stamp.len(), STAMP_LEN, "{stamp}");
        assert_eq!(
            (
                &stamp[4..5],
                &stamp[7..8],
                &stamp[10..11],
                &stamp[19..20],
                &stamp[26..]
            ),
            ("-", "-", "T", ".", "Z"),
            "{stamp}"
        );
        let month = time::Month::try_from(u8::try_from(number(5..7)).unwrap()).unwrap();
        let date = time::Date::from_calendar_date(
            i32::try_from(number(0..4)).unwrap(),
            month,
            u8::try_from(number(8..10)).unwrap(),
        )
        .unwrap();
        let clock = time::Time::from_hms_micro(
            u8::try_from(number(11..13)).unwrap(),
            u8::try_from(number(14..16)).unwrap(),
            u8::try_from(number(17..19)).unwrap(),
            number(20..26),
        )
        .unwrap();
        time::PrimitiveDateTime::new(date, clock).assume_utc()
    }

    /// The timestamp's digits are `time`'s date and time with microseconds, each at its place and
    /// padded, across leap days, century years and the ends of the range; outside it, none.
    #[test]
    fn the_timestamp_is_rfc3339_in_utc_with_microseconds() {
        let mut instants: Vec<u64> = vec![
            0,
            951_782_400,     // 2000-02-29
            951_868_799,     // 2000-02-29T23:59:59
            4_107_542_400,   // 2100-03-01 (2100 is not a leap year)
            1_796_774_400,   // 2026-12-08
            253_402_300_799, // 9999-12-31T23:59:59
        ];
        // Every day of 1970 to 2400 at a moment that moves through the day.
        instants.extend((0..157_000_u64).map(|day| day * 86_400 + (day * 7_919) % 86_400));
        for seconds in instants {
            let micros = (seconds * 104_729) % 1_000_000;
            let time = UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros);
            let utc = time::OffsetDateTime::from(time);
            let expected = format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
                utc.year(),
                u8::from(utc.month()),
                utc.day(),
                utc.hour(),
                utc.minute(),
                utc.second(),
                utc.microsecond()
            );
            let mut buffer = [0u8; STAMP_LEN];
            assert_eq!(rfc3339_micros(time, &mut buffer), Some(expected.as_str()));
        }
        let mut buffer = [0u8; STAMP_LEN];
        let after_9999 = UNIX_EPOCH + Duration::from_secs(253_402_300_800);
        assert_eq!(rfc3339_micros(after_9999, &mut buffer), None);
        let before_1970 = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339_micros(before_1970, &mut buffer), None);
    }
}
