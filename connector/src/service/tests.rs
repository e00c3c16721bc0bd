//! Tests of the service: the reaper backs off from a run whose cleanup leaves residue.

use super::*;
use crate::action::Action;
use crate::clock::Clock;
use crate::executor::ExecFuture;
use crate::executor::{Caller, Executor, Outcome};
use crate::runs::RegistryLimits;
use crate::runs::RunRegistry;
use certistack_core::fixtures::{full_wire_grant, sign};
use certistack_core::validate::NodeName;
use certistack_core::validate::Validated;
use certistack_proto::v1 as pb;
use ed25519_dalek::SigningKey;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

#[derive(Default)]
struct TestClock(AtomicI64);

impl Clock for TestClock {
    fn now_unix_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Answers Cleanup with residue until told the node is clean.
#[derive(Default)]
struct ResidueExecutor {
    cleanups: AtomicUsize,
    clean: std::sync::atomic::AtomicBool,
}

impl Executor for ResidueExecutor {
    fn capabilities(&self) -> Vec<&'static str> {
        Vec::new()
    }
    fn execute<'a>(&'a self, _: &'a Caller, _: Action) -> ExecFuture<'a> {
        self.cleanups.fetch_add(1, Ordering::SeqCst);
        let residue = if self.clean.load(Ordering::SeqCst) {
            Vec::new()
        } else {
            vec!["VM 9100 config".to_owned()]
        };
        Box::pin(async move {
            Ok(Outcome::Cleanup(pb::CleanupReply {
                resources: Vec::new(),
                residue,
                journal_head: String::new(),
            }))
        })
    }
    fn residue<'a>(&'a self, _: &'a crate::runs::RunHandle) -> crate::executor::ResidueFuture<'a> {
        let clean = self.clean.load(Ordering::SeqCst);
        Box::pin(async move {
            Ok(if clean {
                Vec::new()
            } else {
                vec!["VM 9100 config".to_owned()]
            })
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_reaper_backs_off_from_a_run_with_residue() {
    let dir = std::env::temp_dir().join(format!("certistack-reaper-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let key = SigningKey::from_bytes(&[1; 32]);
    let runs = Arc::new(
        RunRegistry::open(&dir, &key.verifying_key(), RegistryLimits::default(), 0).unwrap(),
    );
    let signed = sign(&key, &full_wire_grant());
    let grant = certistack_core::grant::verify(&signed, &key.verifying_key()).unwrap();
    let run_id = grant.run_id.clone();
    runs.begin(&signed, grant, 2_000_000).await.unwrap();
    let executor = Arc::new(ResidueExecutor::default());
    let clock = Arc::new(TestClock::default());
    let service = ConnectorService::new(
        NodeName::validate("pve1").unwrap(),
        crate::policy::SurfacePolicy::compiled()
            .unwrap()
            .gate()
            .unwrap(),
        key.verifying_key(),
        runs.clone(),
        executor.clone(),
        clock.clone(),
        0,
    );
    // The grant's deadline is 4_600 s; the reaper passes every 30 s from 5_000 s on.
    let mut attempts_at = Vec::new();
    for pass in 0..16 {
        let now = 5_000 + pass * 30;
        clock.0.store(now * 1000, Ordering::SeqCst);
        let before = executor.cleanups.load(Ordering::SeqCst);
        service.reap_expired().await;
        if executor.cleanups.load(Ordering::SeqCst) > before {
            attempts_at.push(now);
        }
    }
    // Retried after 60, 120 and 240 s, not on every pass.
    assert_eq!(attempts_at, [5_000, 5_060, 5_180, 5_420]);
    assert_eq!(service.reap_retry_at(&run_id), Some(5_420 + 480));
    assert!(!runs.is_closed(&run_id));
    // Once the node is clean, the next attempt closes the run as expired.
    executor.clean.store(true, Ordering::SeqCst);
    clock.0.store(5_900 * 1000, Ordering::SeqCst);
    service.reap_expired().await;
    assert!(runs.is_closed(&run_id));
    assert_eq!(service.reap_retry_at(&run_id), None);
    // The reaper's passes also prune closed runs past their retention (90 days).
    clock
        .0
        .store((5_900 + 91 * 86_400) * 1000, Ordering::SeqCst);
    service.reap_expired().await;
    assert!(runs.closed_page(None, 10).unwrap().0.is_empty());
    assert!(!crate::runs::closed_run_dir(&dir, &run_id).exists());
    assert!(!runs.is_closed(&run_id));
    std::fs::remove_dir_all(&dir).unwrap();
}
