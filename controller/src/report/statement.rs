//! A Statement built from a validation, and what verifying one recomputes: the journal's hash
//! chain (by `certistack_core::journal`) and the screenshot beside the report.

use super::*;

/// Recomputes the journal chain of `run_id` from `records` with the journal's own reader
/// (`certistack_core::journal::verify_streamed`) and returns its head (hex).
pub fn recompute_journal_head(run_id: &str, records: &[JournalRecord]) -> Result<String, String> {
    let wire: Vec<certistack_proto::v1::JournalRecord> =
        records.iter().map(JournalRecord::to_wire).collect();
    journal::verify_streamed(run_id, &wire).map(hex::encode)
}

impl Statement {
    /// A statement for `validation`, naming its snapshot and archives as subjects.
    pub fn new(validation: Validation) -> Self {
        Self {
            statement_type: STATEMENT_TYPE.to_owned(),
            subject: subjects(&validation.snapshot),
            predicate_type: PREDICATE_TYPE.to_owned(),
            predicate: validation,
        }
    }

    /// Checks what the signature alone does not: the statement's shape, that its subjects are
    /// its snapshot, that the verdict is well-formed, and that the journal recomputes.
    pub fn check(&self) -> Result<(), ReportError> {
        let shape = |m: String| Err(ReportError::Statement(m));
        if self.statement_type != STATEMENT_TYPE {
            return shape(format!(
                "_type is {:?}, expected {STATEMENT_TYPE:?}",
                self.statement_type
            ));
        }
        if self.predicate_type != PREDICATE_TYPE {
            return shape(format!(
                "predicateType is {:?}, expected {PREDICATE_TYPE:?}",
                self.predicate_type
            ));
        }
        let predicate = &self.predicate;
        if self.subject != subjects(&predicate.snapshot) {
            return shape("the subjects are not the predicate's snapshot and archives".into());
        }
        for subject in &self.subject {
            match subject.digest.get("sha256") {
                Some(digest) if !is_sha256_hex(digest) => {
                    return shape(format!(
                        "the sha256 digest of subject {:?} is not 64 lower-case hex digits",
                        subject.name
                    ));
                }
                // A verdict about the backup names the bytes it is about (the manifest is
                // read before any VM exists); only an error verdict may come before that, and
                // a failed one that says there is no backup (`latest` found none finished).
                None if !may_name_no_digest(predicate) => {
                    return shape(format!(
                        "subject {:?} has no sha256 digest, but the verdict is about its bytes",
                        subject.name
                    ));
                }
                _ => {}
            }
        }
        if let Some(verify) = &predicate.snapshot.verify_state {
            verify.check().or_else(shape)?;
        }
        if let Err(reason) = RunId::validate(&predicate.run_id) {
            return shape(format!("run_id: {reason}"));
        }
        if let Verdict::Failed { reasons } | Verdict::Error { reasons } = &predicate.verdict
            && reasons.is_empty()
        {
            return shape("a failed or error verdict gives no reason".into());
        }
        if predicate.verdict == Verdict::Passed && predicate.journal.records.is_empty() {
            return shape(
                "a passed verdict carries no journal record: nothing shows what the node did"
                    .into(),
            );
        }
        if predicate.isolation.ruleset_digest != sha256_text(predicate.isolation.ruleset.as_bytes())
        {
            return shape("isolation.ruleset_digest is not the digest of isolation.ruleset".into());
        }
        if let Some(shot) = &predicate.screenshot
            && (shot.file.is_empty() || shot.file.contains('/') || shot.file.starts_with('.'))
        {
            return shape(format!(
                "screenshot.file {:?} is not a file name beside the report",
                shot.file
            ));
        }
        let head = recompute_journal_head(&predicate.run_id, &predicate.journal.records)
            .map_err(ReportError::Journal)?;
        if head != predicate.journal.head_sha256 {
            return Err(ReportError::Journal(format!(
                "the records end at {head}, the report says {}",
                predicate.journal.head_sha256
            )));
        }
        Ok(())
    }
}

/// Whether a subject may carry no digest: an error verdict (nothing was proven), or a failed
/// one that says there is no finished backup to name.
fn may_name_no_digest(predicate: &Validation) -> bool {
    match predicate.verdict {
        Verdict::Error { .. } => true,
        Verdict::Failed { .. } => predicate
            .snapshot
            .latest
            .as_ref()
            .is_some_and(LatestEvidence::found_none),
        Verdict::Passed => false,
    }
}

/// `sha256:<hex>`, the form digests of texts take in the predicate.
pub fn sha256_text(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// What the screenshot beside a report says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScreenshotCheck {
    /// The report names none.
    NotTaken,
    /// The file is not beside the report (it may have been sent without it).
    Absent(PathBuf),
    Matches(PathBuf),
}

/// Checks the screenshot a verified report names against the file beside `report_path`: a file
/// whose SHA-256 differs makes the report invalid.
pub fn check_screenshot(
    statement: &Statement,
    report_path: &Path,
) -> Result<ScreenshotCheck, ReportError> {
    let Some(shot) = &statement.predicate.screenshot else {
        return Ok(ScreenshotCheck::NotTaken);
    };
    let path = report_path
        .parent()
        .unwrap_or(Path::new("."))
        .join(&shot.file);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ScreenshotCheck::Absent(path));
        }
        Err(error) => return Err(FileError::Read { path, error }.into()),
    };
    let found = hex::encode(Sha256::digest(&bytes));
    if found != shot.sha256 {
        return Err(ReportError::Screenshot {
            path,
            found,
            expected: shot.sha256.clone(),
        });
    }
    Ok(ScreenshotCheck::Matches(path))
}

pub(super) fn subjects(snapshot: &Snapshot) -> Vec<Subject> {
    let mut base = format!(
        "pbs://{}:{}/{}",
        snapshot.server, snapshot.port, snapshot.datastore
    );
    if !snapshot.namespace.is_empty() {
        base = format!("{base}/{}", snapshot.namespace);
    }
    base = format!("{base}/{}", snapshot.snapshot);
    let mut subjects = vec![Subject {
        name: snapshot.snapshot.clone(),
        uri: base.clone(),
        digest: snapshot
            .manifest_sha256
            .iter()
            .map(|digest| ("sha256".to_owned(), digest.clone()))
            .collect(),
    }];
    subjects.extend(snapshot.archives.iter().map(|archive| {
        Subject {
            name: archive.name.clone(),
            uri: format!("{base}/{}", archive.name),
            digest: archive
                .sha256
                .iter()
                .map(|digest| ("sha256".to_owned(), digest.clone()))
                .collect(),
        }
    }));
    subjects
}
