//! The schedule fields of a crontab line in supercronic's grammar (its `cronexpr`), so that a
//! line means in pgleader what it means under supercronic: how many words a line's schedule
//! takes (seven, six or five) is decided by whether they parse in that grammar, never by
//! whether the schedule occurs again; and what supercronic accepts is accepted (`friday`,
//! `january`, `3/3`, `?` in any field, `15W`, `LW`, `5L`, `6#3`).
//!
//! The fields come out in the calendar's dialect (croner's). An entry that dialect reads alike is
//! kept as written (in capitals), so that the canonical form, and with it the definition
//! marker, of a line pgleader read before does not change; only what croner cannot read is
//! rewritten (`FRIDAY` as `FRI`, `3/3` as `3-12/3`).
//!
//! Two things supercronic refuses have an obvious meaning, and pgleader reads them, saying so:
//! a day-of-week range that ends in 7 (`5-7`, `sat-sun`: Sunday), and a step larger than its
//! field (`*/61`: only the first value). They are tried only after every strict reading has
//! failed, so they never change how a line supercronic accepts is cut.

/// A schedule read from the first five, six or seven words of a line.
#[derive(Debug)]
pub struct Fields {
    /// Seconds first, year last, in the calendar's dialect.
    pub seven: [String; 7],
    /// Why supercronic refuses these fields, when pgleader reads them anyway.
    pub refused_by_supercronic: Option<String>,
}

/// Reads `words` (five: minute to weekday; six: and a year; seven: seconds first and a year).
/// `lenient` also reads what only supercronic refuses (see the module's documentation).
pub fn read(words: &[&str], lenient: bool) -> Result<Fields, String> {
    let kinds: &[Kind] = match words.len() {
        7 => &KINDS,
        6 => &KINDS[1..],
        5 => &KINDS[1..6],
        n => return Err(format!("{n} fields (expected five, six or seven)")),
    };
    let mut read = Vec::with_capacity(7);
    let mut refused = None;
    for (word, kind) in words.iter().zip(kinds) {
        let (field, why) = field(word, *kind, lenient)?;
        refused = refused.or(why);
        read.push(field);
    }
    if words.len() < 7 {
        read.insert(0, "0".to_owned());
    }
    if words.len() == 5 {
        read.push("*".to_owned());
    }
    let seven: [String; 7] = read.try_into().expect("seven fields");
    Ok(Fields {
        seven,
        refused_by_supercronic: refused,
    })
}

const KINDS: [Kind; 7] = [
    Kind::Second,
    Kind::Minute,
    Kind::Hour,
    Kind::Day,
    Kind::Month,
    Kind::Weekday,
    Kind::Year,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Second,
    Minute,
    Hour,
    Day,
    Month,
    Weekday,
    Year,
}

const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

const WEEKDAYS: [&str; 7] = [
    "sunday",
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Second => "second",
            Kind::Minute => "minute",
            Kind::Hour => "hour",
            Kind::Day => "day-of-month",
            Kind::Month => "month",
            Kind::Weekday => "day-of-week",
            Kind::Year => "year",
        }
    }

    /// The field's values as supercronic bounds a step and an open range (`N/step` runs to
    /// the maximum): a weekday's maximum is 6, 7 being another name for Sunday.
    fn bounds(self) -> (u32, u32) {
        match self {
            Kind::Second | Kind::Minute => (0, 59),
            Kind::Hour => (0, 23),
            Kind::Day => (1, 31),
            Kind::Month => (1, 12),
            Kind::Weekday => (0, 6),
            Kind::Year => (1970, 2099),
        }
    }

    /// One value (`5`, `05`, `mar`, `march`, `friday`, `2027`): its number (a weekday's 7 stays
    /// 7) and how the calendar spells it.
    fn value(self, text: &str) -> Option<(u32, String)> {
        let names: &[&str] = match self {
            Kind::Month => &MONTHS,
            Kind::Weekday => &WEEKDAYS,
            _ => &[],
        };
        let first = u32::from(self == Kind::Month);
        if let Some(index) = names
            .iter()
            .position(|name| text == *name || text == &name[..3])
        {
            return Some((first + index as u32, names[index][..3].to_ascii_uppercase()));
        }
        let digits = match self {
            Kind::Year => 4..=4,
            _ => 1..=2,
        };
        if !digits.contains(&text.len()) || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let number: u32 = text.parse().ok()?;
        let (min, max) = self.bounds();
        let max = if self == Kind::Weekday { 7 } else { max };
        (min..=max)
            .contains(&number)
            .then(|| (number, text.to_owned()))
    }
}

/// One field: its entries, read and joined again; and why supercronic refuses it, if it does.
fn field(word: &str, kind: Kind, lenient: bool) -> Result<(String, Option<String>), String> {
    let entries: Vec<&str> = word.split(',').filter(|entry| !entry.is_empty()).collect();
    if entries.is_empty() {
        return Err(format!("{} field: missing directive", kind.name()));
    }
    let mut out = Vec::with_capacity(entries.len());
    let mut refused = None;
    for entry in entries {
        let lower = entry.to_ascii_lowercase();
        match entry_of(&lower, kind) {
            Ok(spelled) => out.push(spelled),
            Err(Entry::Refused(why)) => return Err(why),
            Err(Entry::OnlySupercronicRefuses(why, spelled)) if lenient => {
                refused = refused.or(Some(why));
                out.push(spelled);
            }
            Err(Entry::OnlySupercronicRefuses(why, _)) => return Err(why),
        }
    }
    Ok((out.join(","), refused))
}

/// Why an entry is not read as supercronic reads it.
enum Entry {
    Refused(String),
    /// supercronic refuses it; pgleader can read it as the calendar spells it here.
    OnlySupercronicRefuses(String, String),
}

/// One entry of a field, in lower case, as the calendar spells it.
fn entry_of(entry: &str, kind: Kind) -> Result<String, Entry> {
    let syntax = || Entry::Refused(format!("syntax error in {} field: '{entry}'", kind.name()));
    let (_, max) = kind.bounds();
    if entry == "*" || entry == "?" {
        let keep_question = entry == "?" && matches!(kind, Kind::Day | Kind::Weekday);
        return Ok(if keep_question { "?" } else { "*" }.to_owned());
    }
    if let Some((_, spelled)) = kind.value(entry) {
        return Ok(spelled);
    }
    // A weekday's 7 is Sunday: where a range starts, the calendar needs it as 0.
    let start = |text: &str| {
        kind.value(text)
            .map(|(number, spelled)| match (kind, number) {
                (Kind::Weekday, 7) => (0, "0".to_owned()),
                _ => (number, spelled),
            })
    };
    if let Some((range, step)) = entry.split_once('/') {
        let Some((step_number, read_by_supercronic)) = step_of(step) else {
            return Err(syntax());
        };
        let (spelled, reversed) = if range == "*" {
            ("*".to_owned(), false)
        } else if let Some((first, last)) = range.split_once('-') {
            let (Some((a, first)), Some((b, last))) = (start(first), kind.value(last)) else {
                return Err(syntax());
            };
            (format!("{first}-{last}"), sunday_seven(kind, b) < a)
        } else {
            let Some((a, _)) = start(range) else {
                return Err(syntax());
            };
            (format!("{a}-{max}"), false)
        };
        let spelled = format!("{spelled}/{step}");
        if step_number > max {
            return Err(Entry::OnlySupercronicRefuses(
                format!(
                    "a step larger than its {} field ('{entry}': supercronic's go up to {max})",
                    kind.name()
                ),
                spelled,
            ));
        }
        if step_number == 0 || !read_by_supercronic {
            return Err(Entry::Refused(format!("invalid interval {entry}")));
        }
        if reversed {
            return Err(Entry::OnlySupercronicRefuses(
                format!(
                    "a day-of-week range that ends in 7, Sunday ('{entry}': supercronic reads no \
                     day from it)"
                ),
                spelled,
            ));
        }
        return Ok(spelled);
    }
    if let Some((first, last)) = entry.split_once('-') {
        let (Some((a, first)), Some((b, last))) = (start(first), kind.value(last)) else {
            return Err(syntax());
        };
        let spelled = format!("{first}-{last}");
        if sunday_seven(kind, b) >= a {
            return Ok(spelled);
        }
        if kind == Kind::Weekday && b == 7 {
            return Err(Entry::OnlySupercronicRefuses(
                format!("a day-of-week range that ends in 7, Sunday ('{entry}')"),
                spelled,
            ));
        }
        return Err(Entry::Refused(format!(
            "invalid interval {entry} (it ends before it starts)"
        )));
    }
    match kind {
        Kind::Day => match entry {
            "l" => Ok("L".into()),
            "lw" => Ok("LW".into()),
            _ => {
                let day = entry.strip_suffix('w').and_then(|day| kind.value(day));
                day.map(|(_, spelled)| format!("{spelled}W"))
                    .ok_or_else(syntax)
            }
        },
        Kind::Weekday => {
            if let Some((_, spelled)) = entry.strip_suffix('l').and_then(|day| kind.value(day)) {
                return Ok(format!("{spelled}L"));
            }
            let nth = entry.split_once('#').and_then(|(day, nth)| {
                let (_, spelled) = kind.value(day)?;
                matches!(nth, "1" | "2" | "3" | "4" | "5").then(|| format!("{spelled}#{nth}"))
            });
            nth.ok_or_else(syntax)
        }
        _ => Err(syntax()),
    }
}

/// A weekday's 7 as supercronic compares it in a range (Sunday, 0); other values as they are.
fn sunday_seven(kind: Kind, value: u32) -> u32 {
    if kind == Kind::Weekday && value == 7 {
        0
    } else {
        value
    }
}

/// A step: its number, and whether supercronic reads those digits as that number (it knows
/// `0` to `59`, with or without a leading zero below 10, and `1970` to `2099`; anything else it
/// reads as 0, and refuses).
fn step_of(step: &str) -> Option<(u32, bool)> {
    if step.is_empty() || step.len() > 5 || !step.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let number: u32 = step.parse().ok()?;
    let read_by_supercronic = match step.len() {
        1 => true,
        2 => number <= 59,
        4 => (1970..=2099).contains(&number),
        _ => false,
    };
    Some((number, read_by_supercronic))
}
