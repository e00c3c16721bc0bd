//! Reading a journal: verifying the hash chain record by record, a torn tail told apart from
//! corruption, whole ([`read`]) or streamed in bounded memory ([`Reader`], [`summarize`]).

use super::{Entry, JournalError, Op, Record, TornTail, genesis, record_hash};
use crate::files::FileError;
use std::fs::File;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// The result of reading a journal file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub records: Vec<Record>,
    pub torn: Option<TornTail>,
    /// Length of the valid prefix in bytes.
    pub valid_len: u64,
}

impl Loaded {
    pub fn head(&self, run_id: &str) -> [u8; 32] {
        self.records
            .last()
            .map_or_else(|| genesis(run_id), |r| r.hash)
    }
}

fn parse_line(
    line: &[u8],
    expected_previous: &[u8; 32],
    expected_seq: u64,
) -> Result<Record, String> {
    let text = std::str::from_utf8(line).map_err(|_| "not UTF-8".to_string())?;
    let mut parts = text.splitn(3, ' ');
    let (Some(hash_hex), Some(previous_hex), Some(json)) =
        (parts.next(), parts.next(), parts.next())
    else {
        return Err("not `<hash> <previous> <entry>`".into());
    };
    let mut hash = [0u8; 32];
    let mut previous = [0u8; 32];
    hex::decode_to_slice(hash_hex, &mut hash).map_err(|_| "bad record hash".to_string())?;
    hex::decode_to_slice(previous_hex, &mut previous)
        .map_err(|_| "bad previous hash".to_string())?;
    if &previous != expected_previous {
        return Err("previous hash does not match the chain".into());
    }
    if record_hash(&previous, json.as_bytes()) != hash {
        return Err("record hash does not match its contents".into());
    }
    let entry: Entry = serde_json::from_str(json).map_err(|e| format!("entry: {e}"))?;
    if entry.seq != expected_seq {
        return Err(format!(
            "sequence {} where {expected_seq} was expected",
            entry.seq
        ));
    }
    Ok(Record {
        entry,
        previous,
        hash,
    })
}

/// Reads and verifies a journal. A bad last segment is a torn tail; a bad record followed by
/// others is corruption.
pub fn read(path: &Path, run_id: &str) -> Result<Loaded, JournalError> {
    let bytes = std::fs::read(path).map_err(|error| FileError::Read {
        path: path.to_owned(),
        error,
    })?;
    let mut records = Vec::new();
    let mut previous = genesis(run_id);
    let mut offset = 0usize;
    let mut line_number = 0usize;
    while offset < bytes.len() {
        line_number += 1;
        let rest = bytes.get(offset..).unwrap_or_default();
        let (line, next, complete) = match rest.iter().position(|b| *b == b'\n') {
            Some(end) => (rest.get(..end).unwrap_or_default(), offset + end + 1, true),
            None => (rest, bytes.len(), false),
        };
        let result = if complete {
            parse_line(line, &previous, records.len() as u64 + 1)
        } else {
            Err("no line end".into())
        };
        match result {
            Ok(record) => {
                previous = record.hash;
                records.push(record);
                offset = next;
            }
            Err(reason) if next >= bytes.len() => {
                return Ok(Loaded {
                    records,
                    torn: Some(TornTail {
                        offset: offset as u64,
                        bytes: rest.to_vec(),
                        reason,
                    }),
                    valid_len: offset as u64,
                });
            }
            Err(reason) => {
                return Err(JournalError::Corrupt {
                    path: path.to_owned(),
                    line: line_number,
                    reason,
                });
            }
        }
    }
    Ok(Loaded {
        records,
        torn: None,
        valid_len: offset as u64,
    })
}

/// Verifies a journal record by record, holding one line at a time. A bad last line is a torn
/// tail: reading ends there and [`Reader::torn`] reports it; a bad line followed by another is
/// corruption.
#[derive(Debug)]
pub struct Reader<R> {
    input: R,
    path: PathBuf,
    previous: [u8; 32],
    next_seq: u64,
    line_number: usize,
    offset: u64,
    max_line: u64,
    torn: Option<TornTail>,
    done: bool,
}

impl<R: BufRead> Reader<R> {
    /// Reads the journal of `run_id` from `input` (named `path` in errors); a line longer than
    /// `max_line` bytes is treated as a bad record.
    pub fn new(input: R, path: &Path, run_id: &str, max_line: u64) -> Self {
        Self {
            input,
            path: path.to_owned(),
            previous: genesis(run_id),
            next_seq: 1,
            line_number: 0,
            offset: 0,
            max_line,
            torn: None,
            done: false,
        }
    }

    /// The tail set aside as torn, once reading ended.
    pub fn torn(&self) -> Option<&TornTail> {
        self.torn.as_ref()
    }

    /// The hash of the last valid record read (the genesis before any).
    pub fn head(&self) -> [u8; 32] {
        self.previous
    }

    /// Valid records read so far.
    pub fn records_read(&self) -> u64 {
        self.next_seq - 1
    }

    /// Length of the valid prefix read so far, in bytes.
    pub fn valid_len(&self) -> u64 {
        self.offset
    }

    /// One line, its newline included; empty at the end.
    fn line(&mut self) -> Result<Vec<u8>, JournalError> {
        let mut line = Vec::new();
        let limit = self.max_line.saturating_add(1);
        std::io::Read::take(&mut self.input, limit)
            .read_until(b'\n', &mut line)
            .map_err(|error| FileError::Read {
                path: self.path.clone(),
                error,
            })?;
        Ok(line)
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = Result<Record, JournalError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let line = match self.line() {
            Ok(line) if line.is_empty() => {
                self.done = true;
                return None;
            }
            Ok(line) => line,
            Err(error) => {
                self.done = true;
                return Some(Err(error));
            }
        };
        self.line_number += 1;
        let result = match line.strip_suffix(b"\n") {
            Some(body) => parse_line(body, &self.previous, self.next_seq),
            None if line.len() as u64 > self.max_line => {
                Err(format!("longer than {} bytes", self.max_line))
            }
            None => Err("no line end".into()),
        };
        match result {
            Ok(record) => {
                self.previous = record.hash;
                self.next_seq += 1;
                self.offset += line.len() as u64;
                Some(Ok(record))
            }
            Err(reason) => {
                self.done = true;
                // Only the last line may be bad: look one line ahead.
                match self.line() {
                    Ok(next) if next.is_empty() => {
                        self.torn = Some(TornTail {
                            offset: self.offset,
                            bytes: line,
                            reason,
                        });
                        None
                    }
                    Ok(_) => Some(Err(JournalError::Corrupt {
                        path: self.path.clone(),
                        line: self.line_number,
                        reason,
                    })),
                    Err(error) => Some(Err(error)),
                }
            }
        }
    }
}

/// What a journal file holds, read in bounded memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub records: u64,
    pub bytes: u64,
    pub head: [u8; 32],
    /// The operation of the last valid record.
    pub last_op: Option<Op>,
    pub torn: bool,
}

/// Verifies the journal at `path` without keeping its records.
pub fn summarize(path: &Path, run_id: &str, max_line: u64) -> Result<Summary, JournalError> {
    let file = File::open(path).map_err(|error| FileError::Read {
        path: path.to_owned(),
        error,
    })?;
    let mut reader = Reader::new(std::io::BufReader::new(file), path, run_id, max_line);
    let mut last_op = None;
    for record in reader.by_ref() {
        last_op = Some(record?.entry.op);
    }
    Ok(Summary {
        records: reader.records_read(),
        bytes: reader.valid_len(),
        head: reader.head(),
        last_op,
        torn: reader.torn().is_some(),
    })
}
