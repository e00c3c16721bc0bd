//! Refused by identity, grant and policy: run certificates and grants for another node, signed by
//! another key, with another digest, outliving their grant or expired; runs after `EndRun`, after
//! their deadline, overlapping on one node; identities confined to their RPCs.

use super::*;

/// A run certificate bound to whatever grant bytes `signed` carries (signed by any key, for any
/// node) on this node, valid from a minute ago until `not_after`: the controller's own minting
/// refuses such grants, these tests need them.
fn run_certificate(
    authority: &certistack_controller::authority::Authority,
    signed: &pb::SignedRunGrant,
    not_after: time::OffsetDateTime,
) -> certistack_controller::authority::IssuedCertificate {
    let identity = Identity::Run {
        run_id: RunId::validate(RUN_ID).unwrap(),
        grant_sha256: certistack_core::grant::digest(&signed.grant),
        node: NodeName::validate(NODE).unwrap(),
    };
    authority
        .issue_client(&identity, now() - time::Duration::minutes(1), not_after)
        .unwrap()
}

#[tokio::test]
async fn run_certificate_for_another_node_is_refused() {
    let (_dir, authority, node) = started_node("othernode").await;
    let credentials = mint(&authority, &grant(RUN_ID, "pve2"));
    let mut client = run_client(&authority, &node, &credentials).await;
    assert_status(
        client.hello(pb::HelloRequest {}).await,
        Code::PermissionDenied,
        "bound to node pve2, this is node pve1",
    );
    assert_status(
        client.begin_run(begin_request(&credentials)).await,
        Code::PermissionDenied,
        "bound to node pve2",
    );
    assert_eq!(node.executor.count(), 0);
}

/// Until when the run certificate carrying a refused grant is valid.
enum CertificateUntil {
    /// The grant's own deadline, as the controller mints it.
    GrantDeadline,
    /// An hour past the grant's deadline.
    AnHourAfterTheGrantDeadline,
    /// Five minutes from now: still valid, to reach the grant's own time check.
    FiveMinutesFromNow,
}

/// A grant `BeginRun` refuses, and how it is made: the node it names, whether its window has
/// passed, whether another controller's run authority signs it, and until when the run
/// certificate carrying it is valid.
struct RefusedGrant {
    case: &'static str,
    node: &'static str,
    expired: bool,
    signed_by_another_controller: bool,
    certificate_until: CertificateUntil,
    refusal: &'static str,
}

const REFUSED_GRANTS: &[RefusedGrant] = &[
    // The certificate is bound to this node, the grant it carries names another.
    RefusedGrant {
        case: "grant for another node",
        node: "pve2",
        expired: false,
        signed_by_another_controller: false,
        certificate_until: CertificateUntil::GrantDeadline,
        refusal: "the grant is for node pve2, this is node pve1",
    },
    RefusedGrant {
        case: "grant signed by another key",
        node: NODE,
        expired: false,
        signed_by_another_controller: true,
        certificate_until: CertificateUntil::GrantDeadline,
        refusal: "does not verify against the pinned run-authority key",
    },
    RefusedGrant {
        case: "run certificate outliving its grant",
        node: NODE,
        expired: false,
        signed_by_another_controller: false,
        certificate_until: CertificateUntil::AnHourAfterTheGrantDeadline,
        refusal: "must not outlive its grant",
    },
    RefusedGrant {
        case: "expired grant",
        node: NODE,
        expired: true,
        signed_by_another_controller: false,
        certificate_until: CertificateUntil::FiveMinutesFromNow,
        refusal: "deadline",
    },
];

/// Each refused grant, on a node of its own: `BeginRun` is refused with PERMISSION_DENIED naming
/// why, the run has not begun, and nothing reached the executor.
#[tokio::test]
async fn grants_outside_the_rules_are_refused_at_begin_run() {
    for case in REFUSED_GRANTS {
        let (dir, authority, node) = started_node("refusedgrant").await;
        let mut wire = grant(RUN_ID, case.node);
        if case.expired {
            wire.not_before_unix = now().unix_timestamp() - 7200;
            wire.deadline_unix = now().unix_timestamp() - 3600;
        }
        let signed = if case.signed_by_another_controller {
            let other = controller(&dir.0.join("other"));
            sign_grant(other.run_authority(), &wire)
        } else {
            sign_grant(authority.run_authority(), &wire)
        };
        let deadline = time::OffsetDateTime::from_unix_timestamp(wire.deadline_unix).unwrap();
        let not_after = match case.certificate_until {
            CertificateUntil::GrantDeadline => deadline,
            CertificateUntil::AnHourAfterTheGrantDeadline => deadline + time::Duration::hours(1),
            CertificateUntil::FiveMinutesFromNow => now() + time::Duration::minutes(5),
        };
        let cert = run_certificate(&authority, &signed, not_after);
        let mut client = client(&authority, &node.address, NODE, &cert)
            .await
            .unwrap();
        let result = client
            .begin_run(pb::BeginRunRequest {
                grant: Some(signed),
            })
            .await;
        assert_case_status(case.case, result, Code::PermissionDenied, case.refusal);
        let result = client.vm_status(pb::VmRequest { vmid: VMID }).await;
        assert_case_status(case.case, result, Code::FailedPrecondition, "has not begun");
        assert_eq!(node.executor.count(), 0, "{}", case.case);
    }
}

#[tokio::test]
async fn grant_digest_must_match_the_certificate() {
    let (_dir, authority, node) = started_node("digest").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    // Same run, a validly signed grant with a wider scope: not the one the certificate names.
    let mut wider = grant(RUN_ID, NODE);
    wider.archives.push("drive-scsi1.img".into());
    let other_signed = sign_grant(authority.run_authority(), &wider);
    let mut client = run_client(&authority, &node, &credentials).await;
    let result = client
        .begin_run(pb::BeginRunRequest {
            grant: Some(other_signed),
        })
        .await;
    assert_status(result, Code::PermissionDenied, "differs from the digest");
    let result = client.begin_run(pb::BeginRunRequest { grant: None }).await;
    assert_status(result, Code::InvalidArgument, "grant is missing");

    // The run begins with its grant; a certificate minted for another grant of the same run
    // id can neither operate nor end it.
    client.begin_run(begin_request(&credentials)).await.unwrap();
    let stray = mint(&authority, &wider);
    let mut stray_client = run_client(&authority, &node, &stray).await;
    let denied = "the certificate's grant digest differs from the grant this run began with";
    assert_status(
        stray_client.vm_status(pb::VmRequest { vmid: VMID }).await,
        Code::PermissionDenied,
        denied,
    );
    assert_status(
        stray_client.end_run(pb::EndRunRequest {}).await,
        Code::PermissionDenied,
        denied,
    );
    assert_eq!(node.executor.count(), 0);
    client.end_run(pb::EndRunRequest {}).await.unwrap();
}

#[tokio::test]
async fn run_is_refused_after_end_run_also_across_restart() {
    let (_dir, authority, node) = started_node("endrun").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut client = run_client(&authority, &node, &credentials).await;
    client.begin_run(begin_request(&credentials)).await.unwrap();
    client
        .vm_status(pb::VmRequest { vmid: VMID })
        .await
        .unwrap();
    client.end_run(pb::EndRunRequest {}).await.unwrap();
    assert_eq!(node.executor.count(), 1);

    let closed = "was closed by EndRun";
    assert_status(
        client.vm_status(pb::VmRequest { vmid: VMID }).await,
        Code::PermissionDenied,
        closed,
    );
    assert_status(
        client.begin_run(begin_request(&credentials)).await,
        Code::PermissionDenied,
        closed,
    );
    assert_status(
        client.end_run(pb::EndRunRequest {}).await,
        Code::PermissionDenied,
        closed,
    );
    assert_status(
        client.hello(pb::HelloRequest {}).await,
        Code::PermissionDenied,
        closed,
    );

    let node = node.restart().await;
    let mut client = run_client(&authority, &node, &credentials).await;
    assert_status(
        client.hello(pb::HelloRequest {}).await,
        Code::PermissionDenied,
        closed,
    );
    assert_status(
        client.begin_run(begin_request(&credentials)).await,
        Code::PermissionDenied,
        closed,
    );
    assert_status(
        client.vm_status(pb::VmRequest { vmid: VMID }).await,
        Code::PermissionDenied,
        closed,
    );
    assert_eq!(node.executor.count(), 0);

    let mut operator = operator(&authority, &node).await;
    let runs = operator
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(runs[0].state, pb::RunState::Closed as i32);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_nobody_ends_is_cleaned_up_and_closed_after_its_deadline() {
    let (dir, authority, mut config) = enrolled_node("expiry");
    config.limits.expiry_grace_secs = 0;
    let clock = std::sync::Arc::new(ManualClock::default());
    let executor = std::sync::Arc::new(RecordingExecutor::default());
    let node = TestNode::serve(
        dir.0.join("node"),
        config.clone(),
        executor.clone(),
        clock.clone(),
    )
    .await;
    let mut client = begun_run(&authority, &node.address, &grant(RUN_ID, NODE)).await;
    client
        .vm_status(pb::VmRequest { vmid: VMID })
        .await
        .unwrap();

    clock.advance(time::Duration::hours(2));
    let closed_dir = certistack_connector::runs::closed_run_dir(
        &config.paths.state_dir,
        &certistack_core::validate::RunId::validate(RUN_ID).unwrap(),
    );
    let closed = closed_dir.join("closed");
    for _ in 0..50 {
        if closed.exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(closed.exists(), "the expired run was not closed");
    assert_eq!(executor.rpcs(), ["VmStatus", "Cleanup"]);
    let journal = std::fs::read_to_string(closed_dir.join("journal")).unwrap();
    let ops: Vec<&str> = journal
        .lines()
        .filter_map(|l| l.split("\"op\":\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(ops, ["run.begin", "run.expired"]);
}

#[tokio::test]
async fn runs_on_one_node_never_overlap() {
    let (_dir, authority, node) = started_node("overlap").await;
    let first = mint(&authority, &grant(RUN_ID, NODE));
    run_client(&authority, &node, &first)
        .await
        .begin_run(begin_request(&first))
        .await
        .unwrap();
    let other_run = "11111111-2222-4333-8444-555555555555";
    let disjoint = |edit: &dyn Fn(&mut pb::RunGrant)| {
        let mut wire = grant(other_run, NODE);
        wire.sandbox_vms = vec![pb::SandboxVm {
            vmid: 9200,
            max_cores: 1,
            max_memory_mib: 512,
        }];
        wire.vnet = "csbox2".into();
        wire.archives = vec!["drive-scsi1.img".into()];
        edit(&mut wire);
        wire
    };
    type Edit<'a> = &'a dyn Fn(&mut pb::RunGrant);
    let cases: [(Edit, &str); 3] = [
        (
            &|g| g.sandbox_vms[0].vmid = VMID,
            "would share VMID 9100 with open run 0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
        ),
        (&|g| g.vnet = VNET.into(), "would share VNet csbox1"),
        (
            &|g| g.archives = vec![ARCHIVE.into()],
            "would share archive drive-scsi0.img of vm/100/2026-11-01T02:00:00Z",
        ),
    ];
    for (edit, needle) in cases {
        let credentials = mint(&authority, &disjoint(edit));
        let mut c = run_client(&authority, &node, &credentials).await;
        assert_status(
            c.begin_run(begin_request(&credentials)).await,
            Code::FailedPrecondition,
            needle,
        );
    }
    // The same archive of another snapshot is another object.
    let other_snapshot = mint(
        &authority,
        &disjoint(&|g| {
            g.archives = vec![ARCHIVE.into()];
            g.snapshot = "vm/100/2026-10-01T02:00:00Z".into();
        }),
    );
    run_client(&authority, &node, &other_snapshot)
        .await
        .begin_run(begin_request(&other_snapshot))
        .await
        .unwrap();
    assert_eq!(node.executor.count(), 0);
}

#[tokio::test]
async fn identities_are_confined_to_their_rpcs() {
    let (_dir, authority, node) = started_node("confined").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut run = run_client(&authority, &node, &credentials).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    assert_status(
        run.list_runs(pb::ListRunsRequest::default()).await,
        Code::PermissionDenied,
        "a Run identity may not call ListRuns",
    );

    let mut operator = operator(&authority, &node).await;
    let denied = "a Operator identity may not call";
    assert_status(
        operator.begin_run(begin_request(&credentials)).await,
        Code::PermissionDenied,
        denied,
    );
    assert_status(
        operator.end_run(pb::EndRunRequest {}).await,
        Code::PermissionDenied,
        denied,
    );
    let results = call_every_operation(&mut operator).await;
    for (result, rpc) in results.into_iter().zip(EVERY_OPERATION) {
        match rpc {
            // Recovery RPCs are an operator's by policy; every other operation is refused.
            "ReadJournal" | "Cleanup" => result.unwrap(),
            _ => assert_status(result, Code::PermissionDenied, denied),
        }
    }
    assert_eq!(node.executor.rpcs(), ["Cleanup"]);
}

#[tokio::test]
async fn operations_before_begin_run_are_refused() {
    let (_dir, authority, node) = started_node("notbegun").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut client = run_client(&authority, &node, &credentials).await;
    for result in call_every_operation(&mut client).await {
        assert_status(
            result,
            Code::FailedPrecondition,
            "call BeginRun with its grant first",
        );
    }
    assert_status(
        client.end_run(pb::EndRunRequest {}).await,
        Code::FailedPrecondition,
        "has not begun",
    );
    assert_eq!(node.executor.count(), 0);
}
