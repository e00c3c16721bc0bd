//! Source hardware: the sandbox VM gets the source VM's shape from the snapshot's config, and
//! source configs and shapes outside the rules are refused.

use super::*;

const EFI_ARCHIVE: &str = "drive-efidisk0.img";
const VIRTIO_ARCHIVE: &str = "drive-virtio0.img";
const SATA_ARCHIVE: &str = "drive-sata0.img";
const VIRTIO_BOOT_MARKER: &str = "VIRTIO-BLK-BOOT-7f3a";

/// A UEFI guest: OVMF with a 4 MiB EFI vars disk, q35, an x86-64-v2 CPU, a TPM and a NIC on
/// the source's bridge.
const UEFI_SOURCE: &str = "#web server\nbios: ovmf\nboot: order=scsi0;ide2;net0\ncores: 2\ncpu: x86-64-v2-AES\nefidisk0: local-lvm:vm-100-disk-0,efitype=4m,pre-enrolled-keys=1,size=4M\nide2: local:iso/debian-13.iso,media=cdrom,size=700M\nmachine: q35\nmemory: 2048\nname: web\nnet0: virtio=BC:24:11:AA:BB:01,bridge=vmbr0,firewall=1,tag=30\nostype: l26\nscsi0: local-lvm:vm-100-disk-1,iothread=1,size=8M\nscsihw: virtio-scsi-single\ntpmstate0: local-lvm:vm-100-disk-2,size=4M,version=v2.0\n\n[before-upgrade]\ncpu: host\nbios: seabios\n";

/// A SeaBIOS guest on i440fx with its system disk on virtio-blk, a data disk on SATA, an e1000
/// NIC, and host devices passed through.
const VIRTIO_SATA_PASSTHROUGH_SOURCE: &str = "args: -device pci-testdev\nboot: order=virtio0;net0\nhookscript: local:snippets/notify.pl\nhostpci0: 0000:01:00.0,pcie=0\nmachine: pc\nnet0: e1000=BC:24:11:AA:BB:02,bridge=vmbr1\nostype: win10\nsata0: local-lvm:vm-100-disk-3,size=8M\nsata1: none,media=cdrom\nserial0: /dev/ttyS0\nusb0: host=046d:c52b\nvirtio0: local-lvm:vm-100-disk-4,size=8M\n";

/// A guest that passes the node's CPU through (`cpu: host`), with a legacy NIC and a legacy
/// SCSI controller: what the node's hardware policy changes.
const HOST_CPU_LEGACY_DEVICES_SOURCE: &str = "boot: order=scsi0;net0\ncpu: host\nnet0: rtl8139=BC:24:11:AA:BB:03,bridge=vmbr0\nostype: l26\nscsi0: local-lvm:vm-100-disk-1,size=8M\nscsihw: megasas\n";

impl Run {
    async fn read_source(&mut self) -> Result<pb::ReadSourceConfigReply, tonic::Status> {
        self.client
            .read_source_config(pb::ReadSourceConfigRequest {
                snapshot: SNAPSHOT.into(),
                pbs_secret: PBS_PASSWORD.into(),
                encryption_key: vec![],
            })
            .await
            .map(tonic::Response::into_inner)
    }

    async fn map_and_overlay_all(&mut self, vmid: u32, archives: &[&str]) {
        for archive in archives {
            if !self.loops().iter().any(|(name, _)| name.contains(archive)) {
                self.client
                    .map_backup(map_request(archive, PBS_PASSWORD))
                    .await
                    .unwrap();
            }
            self.client
                .create_overlay(pb::CreateOverlayRequest {
                    vmid,
                    archive: (*archive).into(),
                })
                .await
                .unwrap();
        }
    }

    async fn create_mirrored(
        &mut self,
        vmid: u32,
        archives: &[&str],
    ) -> Result<pb::CreateVmReply, tonic::Status> {
        self.client
            .create_vm(pb::CreateVmRequest {
                vmid,
                cores: 1,
                memory_mib: 256,
                archives: archives.iter().map(|a| (*a).to_owned()).collect(),
                mirror_source_hardware: true,
            })
            .await
            .map(tonic::Response::into_inner)
    }

    /// The QEMU command line the qm double started `vmid` with.
    fn qemu_argv(&self, vmid: u32) -> Vec<String> {
        let pid = format!("{vmid}.pid");
        self.lab
            .calls()
            .into_iter()
            .rev()
            .find(|c| {
                c["event"] == "qemu-start"
                    && c["argv_qemu"]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|v| v.as_str().unwrap().ends_with(&pid)))
            })
            .map(|c| {
                c["argv_qemu"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_else(|| panic!("QEMU of VM {vmid} was not started"))
    }

    /// QEMU's own view of the VM's block devices (QMP `query-block` through the connector).
    async fn query_block(&mut self, vmid: u32) -> serde_json::Value {
        let reply = self
            .client
            .qmp(pb::QmpRequest {
                vmid,
                command: pb::QmpCommand::QueryBlock as i32,
            })
            .await
            .unwrap()
            .into_inner();
        serde_json::from_str(&reply.result_json).unwrap()
    }
}

/// `key: value` of a PVE config's top section.
fn conf_value(conf: &str, key: &str) -> Option<String> {
    conf.lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .map(str::to_owned)
}

/// Sandbox VMs get the source VM's hardware from the snapshot's `qemu-server.conf`: a UEFI
/// guest its OVMF firmware with an overlay of the backed-up EFI vars, its q35 machine, its
/// x86-64-v2-AES CPU and virtio-scsi-single; a virtio-blk/SATA guest its buses and slots, its
/// i440fx machine and its e1000 NIC. Each NIC is on the sandbox VNet with a fresh MAC and the
/// firewall off; CD-ROM drives are empty; passthrough, hookscript, raw args, the TPM and the
/// source's bridge are reported as omitted and never reach the VM. QEMU itself (its command
/// line and QMP `query-block`) shows the devices.
#[test]
fn sandbox_vms_mirror_the_source_hardware() {
    if !privileged("sandbox_vms_mirror_the_source_hardware", QEMU_TOOLS)
        || !has_files(
            "sandbox_vms_mirror_the_source_hardware",
            &[("/usr/share/OVMF/OVMF_VARS_4M.fd", "ovmf")],
        )
    {
        return;
    }
    let ovmf_vars: &'static std::path::Path =
        std::path::Path::new("/usr/share/OVMF/OVMF_VARS_4M.fd");
    let netns = Netns::new("srchw", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, move || async move {
        let archives = [ARCHIVE, EFI_ARCHIVE, VIRTIO_ARCHIVE, SATA_ARCHIVE];
        let mut run = Run::begin_with(
            "srchw",
            &archives,
            |lab| {
                // The EFI vars archive is a real OVMF vars store, as PVE backs it up.
                let efi = lab.root.join("pbs/store1").join(SNAPSHOT).join(EFI_ARCHIVE);
                std::fs::copy(ovmf_vars, efi).unwrap();
                // The virtio-blk system disk is the lab guest: it boots only if its kernel
                // finds its data partition on the virtio-blk disk.
                lab.add_guest_backup(
                    SNAPSHOT,
                    VIRTIO_ARCHIVE,
                    &GuestDisk {
                        marker: VIRTIO_BOOT_MARKER,
                        address: "10.77.9.10/24",
                        agent: true,
                        boots: true,
                    },
                );
                lab.add_source_config(SNAPSHOT, UEFI_SOURCE);
            },
            |wire| {
                sandbox_grant(wire);
                wire.qga_assertions.push(pb::QgaAssertion {
                    id: "lab-banner".into(),
                    program: "/bin/cat".into(),
                    args: vec!["/run/banner".into()],
                    expect_exit_code: 0,
                    expect_stdout_contains: format!("CERTISTACK-LAB {VIRTIO_BOOT_MARKER}"),
                    timeout_seconds: 20,
                });
            },
        )
        .await;
        run.client
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();

        // UEFI guest.
        let read = run.read_source().await.unwrap();
        let hw = read.hardware.clone().unwrap();
        assert_eq!(
            (hw.cpu.as_str(), hw.bios.as_str(), hw.machine.as_str()),
            ("x86-64-v2-AES", "ovmf", "q35")
        );
        assert!(hw.efidisk && hw.pre_enrolled_keys && hw.efitype == "4m");
        let omitted: Vec<&str> = hw.omitted.iter().map(|o| o.key.as_str()).collect();
        assert!(omitted.contains(&"tpmstate0") && omitted.contains(&"net0"));
        assert!(hw.changed.is_empty(), "{:?}", hw.changed);
        run.map_and_overlay_all(9100, &[ARCHIVE, EFI_ARCHIVE]).await;
        run.create_mirrored(9100, &[ARCHIVE, EFI_ARCHIVE])
            .await
            .unwrap();
        let conf = run.conf(9100);
        let overlays = run.lab.root.join(format!("overlays/{RUN_ID}"));
        for (key, value) in [
            ("bios", "ovmf".to_owned()),
            ("cpu", "x86-64-v2-AES".into()),
            ("machine", "q35".into()),
            ("ostype", "l26".into()),
            ("scsihw", "virtio-scsi-single".into()),
            ("ide2", "none,media=cdrom".into()),
            ("boot", "order=scsi0;ide2;net0".into()),
        ] {
            assert_eq!(conf_value(&conf, key), Some(value), "{key} in\n{conf}");
        }
        let efidisk = conf_value(&conf, "efidisk0").unwrap();
        assert!(
            efidisk.starts_with(&format!("{}/9100-drive-efidisk0.qcow2", overlays.display()))
                && efidisk.contains("efitype=4m")
                && efidisk.contains("pre-enrolled-keys=1"),
            "{efidisk}"
        );
        let net0 = conf_value(&conf, "net0").unwrap();
        assert!(
            net0.starts_with("virtio=")
                && net0.contains("bridge=csbox1")
                && net0.contains("firewall=0"),
            "{net0}"
        );
        for absent in [
            "vmbr0",
            "BC:24:11:AA:BB:01",
            "tag=",
            "tpmstate0",
            "local-lvm",
        ] {
            assert!(
                !conf.contains(absent),
                "{absent} reached the sandbox:\n{conf}"
            );
        }
        run.client
            .start_vm(pb::VmRequest { vmid: 9100 })
            .await
            .unwrap();
        let argv = run.qemu_argv(9100).join(" ");
        for expected in [
            "if=pflash,unit=0,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
            "if=pflash,unit=1,id=drive-efidisk0,format=qcow2,file=",
            "-cpu qemu64,+aes,+popcnt",
            "-machine q35",
            "virtio-scsi-pci,id=virtioscsi0",
        ] {
            assert!(argv.contains(expected), "{expected} not in {argv}");
        }
        let blocks = run.query_block(9100).await.to_string();
        for device in ["drive-efidisk0", "drive-scsi0", "ide2"] {
            assert!(blocks.contains(device), "{device} not in {blocks}");
        }
        assert!(blocks.contains("9100-drive-efidisk0.qcow2"), "{blocks}");
        // TCG has two cores to share: the firmware of a guest without an OS need not spin on.
        run.client
            .stop_vm(pb::StopVmRequest {
                vmid: 9100,
                timeout_seconds: 5,
            })
            .await
            .unwrap();

        // virtio-blk + SATA guest with passthrough: a config of the same snapshot, read again.
        run.lab
            .add_source_config(SNAPSHOT, VIRTIO_SATA_PASSTHROUGH_SOURCE);
        let read = run.read_source().await.unwrap();
        let hw = read.hardware.unwrap();
        let reasons: std::collections::BTreeMap<&str, &str> = hw
            .omitted
            .iter()
            .map(|o| (o.key.as_str(), o.reason.as_str()))
            .collect();
        for key in ["hostpci0", "usb0", "serial0"] {
            assert!(reasons[key].contains("passthrough"), "{key}: {reasons:?}");
        }
        assert!(reasons["hookscript"].contains("never run"));
        assert!(reasons["args"].contains("never passed"));
        assert!(reasons["net0"].contains("run's VNet"));
        assert!(hw.changed.is_empty(), "{:?}", hw.changed);
        run.map_and_overlay_all(9101, &[VIRTIO_ARCHIVE, SATA_ARCHIVE])
            .await;
        run.create_mirrored(9101, &[VIRTIO_ARCHIVE, SATA_ARCHIVE])
            .await
            .unwrap();
        let conf = run.conf(9101);
        assert!(
            conf_value(&conf, "virtio0")
                .unwrap()
                .starts_with(&format!("{}/9101-drive-virtio0.qcow2,", overlays.display())),
            "{conf}"
        );
        assert!(
            conf_value(&conf, "sata0")
                .unwrap()
                .starts_with(&format!("{}/9101-drive-sata0.qcow2,", overlays.display())),
            "{conf}"
        );
        assert_eq!(
            conf_value(&conf, "sata1").as_deref(),
            Some("none,media=cdrom")
        );
        assert_eq!(conf_value(&conf, "machine").as_deref(), Some("pc"));
        assert_eq!(conf_value(&conf, "ostype").as_deref(), Some("win10"));
        assert_eq!(
            conf_value(&conf, "boot").as_deref(),
            Some("order=virtio0;net0")
        );
        assert!(conf_value(&conf, "net0").unwrap().starts_with("e1000="));
        for absent in [
            "hostpci",
            "usb0",
            "serial0",
            "hookscript",
            "args",
            "vmbr1",
            "scsi0",
        ] {
            assert!(
                !conf.contains(absent),
                "{absent} reached the sandbox:\n{conf}"
            );
        }
        run.client
            .start_vm(pb::VmRequest { vmid: 9101 })
            .await
            .unwrap();
        let argv = run.qemu_argv(9101).join(" ");
        for expected in [
            "-machine pc ",
            "virtio-blk-pci,drive=drive-virtio0,id=virtio0,bootindex=100",
            "ich9-ahci,id=ahci0",
            "ide-hd,bus=ahci0.0,drive=drive-sata0,id=sata0",
            "e1000,netdev=net0",
            "-cpu kvm64",
        ] {
            assert!(argv.contains(expected), "{expected} not in {argv}");
        }
        let blocks = run.query_block(9101).await.to_string();
        for device in ["drive-virtio0", "drive-sata0", "9101-drive-virtio0.qcow2"] {
            assert!(blocks.contains(device), "{device} not in {blocks}");
        }
        // The restored guest boots from its virtio-blk disk (SeaBIOS, SYSLINUX, the kernel, an
        // initramfs reading its data partition on /dev/vda2): the banner it built from the
        // disk's marker is what the guest agent reads back.
        let booted = std::time::Instant::now();
        loop {
            let answer = run
                .client
                .qga(pb::QgaRequest {
                    vmid: 9101,
                    call: Some(pb::qga_request::Call::AssertionId("lab-banner".into())),
                })
                .await;
            if let Ok(reply) = &answer
                && reply.get_ref().assertion_passed
            {
                break;
            }
            assert!(
                booted.elapsed() < std::time::Duration::from_secs(240),
                "the guest did not boot from virtio-blk: {answer:?}"
            );
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
        let journal = run.journal().await;
        assert_eq!(
            journal
                .iter()
                .filter(|s| *s == "source.config source:qemu-server.conf done")
                .count(),
            2,
            "{journal:?}"
        );
        run.end().await;
    });
}

/// A source passing the node's CPU through (`cpu: host`), with an rtl8139 NIC and a megasas
/// controller: the sandbox gets what the node's hardware policy puts in their place, PVE's
/// default named CPU model (x86-64-v2-AES), an e1000 (the NIC keeps its slot and boot place)
/// and virtio-scsi-pci, and the reply, and from it the controller's report, lists each change
/// with the source's model. QEMU's command line shows the replacements.
#[test]
fn sandbox_vms_get_the_policys_models_for_the_nodes_cpu_and_legacy_devices() {
    if !privileged(
        "sandbox_vms_get_the_policys_models_for_the_nodes_cpu_and_legacy_devices",
        QEMU_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("srcpol", &["csbox1", "csbox91", "csbox92"]);
    inside(&netns.name, move || async move {
        let mut run = Run::begin_with(
            "srcpol",
            &[ARCHIVE],
            |lab| {
                lab.add_source_config(SNAPSHOT, HOST_CPU_LEGACY_DEVICES_SOURCE);
            },
            sandbox_grant,
        )
        .await;
        run.client
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();
        // `cpu: host`, an rtl8139 NIC and a megasas controller: the node's hardware policy gives
        // the sandbox PVE's default named CPU model, an e1000 and virtio-scsi, and the reply
        // (and from it the controller's report) lists each change with the source's model.
        let read = run.read_source().await.unwrap();
        let hw = read.hardware.clone().unwrap();
        assert_eq!(
            (hw.cpu.as_str(), hw.scsihw.as_str()),
            ("x86-64-v2-AES", "virtio-scsi-pci")
        );
        let nics: Vec<(u32, &str)> = hw
            .nics
            .iter()
            .map(|n| (n.index, n.model.as_str()))
            .collect();
        assert_eq!(nics, [(0, "e1000")]);
        let changed: Vec<(&str, &str, &str)> = hw
            .changed
            .iter()
            .map(|c| (c.key.as_str(), c.original.as_str(), c.replacement.as_str()))
            .collect();
        assert_eq!(
            changed,
            [
                ("cpu", "host", "x86-64-v2-AES"),
                ("net0", "rtl8139", "e1000"),
                ("scsihw", "megasas", "virtio-scsi-pci"),
            ]
        );
        let report = certistack_controller::report::SandboxHardware::from_wire(
            &hw,
            &read.config_sha256,
            &[ARCHIVE.to_owned()],
        );
        assert_eq!(report.cpu, "x86-64-v2-AES");
        assert_eq!(report.nics, ["net0=e1000"]);
        assert_eq!(report.changed.len(), 3, "{:?}", report.changed);
        assert!(
            report.changed[0].starts_with("cpu: host -> x86-64-v2-AES (")
                && report.changed[1].starts_with("net0: rtl8139 -> e1000 (")
                && report.changed[2].starts_with("scsihw: megasas -> virtio-scsi-pci ("),
            "{:?}",
            report.changed
        );
        run.map_and_overlay_all(9102, &[ARCHIVE]).await;
        run.create_mirrored(9102, &[ARCHIVE]).await.unwrap();
        let conf = run.conf(9102);
        for (key, value) in [
            ("cpu", "x86-64-v2-AES"),
            ("scsihw", "virtio-scsi-pci"),
            ("boot", "order=scsi0;net0"),
        ] {
            assert_eq!(
                conf_value(&conf, key).as_deref(),
                Some(value),
                "{key} in\n{conf}"
            );
        }
        assert!(
            conf_value(&conf, "net0").unwrap().starts_with("e1000="),
            "{conf}"
        );
        for absent in ["rtl8139", "megasas"] {
            assert!(
                !conf.contains(absent),
                "{absent} reached the sandbox:\n{conf}"
            );
        }
        run.client
            .start_vm(pb::VmRequest { vmid: 9102 })
            .await
            .unwrap();
        let argv = run.qemu_argv(9102).join(" ");
        assert!(argv.contains("-cpu qemu64,+aes,+popcnt"), "{argv}");
        assert!(argv.contains("e1000,netdev=net0"), "{argv}");
        for absent in ["-cpu max", "rtl8139"] {
            assert!(!argv.contains(absent), "{absent} in {argv}");
        }
        run.client
            .stop_vm(pb::StopVmRequest {
                vmid: 9102,
                timeout_seconds: 5,
            })
            .await
            .unwrap();

        run.end().await;
    });
}

/// What the node never mirrors: a CreateVm asking for the source's shape before the config
/// was read, an archive the source config does not name as a disk, an archive or snapshot
/// outside the grant; and configs that are missing, oversized or not a config at all.
#[tokio::test(flavor = "multi_thread")]
async fn source_configs_and_shapes_outside_the_rules_are_refused() {
    if !privileged(
        "source_configs_and_shapes_outside_the_rules_are_refused",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    {
        let mut run = Run::begin_with(
            "srcrefuse",
            &[ARCHIVE, VIRTIO_ARCHIVE],
            |lab| {
                lab.add_source_config(SNAPSHOT, "virtio0: local-lvm:vm-100-disk-0,size=8M\n");
            },
            sandbox_grant,
        )
        .await;
        run.map_and_overlay_all(9100, &[ARCHIVE, VIRTIO_ARCHIVE])
            .await;
        assert_status(
            run.create_mirrored(9100, &[VIRTIO_ARCHIVE]).await,
            Code::FailedPrecondition,
            "this run has not read the source VM's config: call ReadSourceConfig first",
        );
        run.read_source().await.unwrap();
        assert_status(
            run.create_mirrored(9100, &[VIRTIO_ARCHIVE, ARCHIVE]).await,
            Code::FailedPrecondition,
            "VM 9100 cannot mirror the source: drive-scsi0.img is not a disk of the source config (its disks: drive-virtio0.img)",
        );
        assert_status(
            run.create_mirrored(9100, &[SATA_ARCHIVE]).await,
            Code::PermissionDenied,
            "archive drive-sata0.img is not granted",
        );
        let other = run
            .client
            .read_source_config(pb::ReadSourceConfigRequest {
                snapshot: "vm/100/2026-10-01T02:00:00Z".into(),
                pbs_secret: PBS_PASSWORD.into(),
                encryption_key: vec![],
            })
            .await;
        assert_status(
            other,
            Code::PermissionDenied,
            "snapshot vm/100/2026-10-01T02:00:00Z is not granted",
        );
        assert!(!run.lab.root.join("etc/pve/qemu-server/9100.conf").exists());

        for (config, needle) in [
            (
                format!("virtio0: x\ndescription: {}\n", "a".repeat(70 * 1024)),
                "is larger than 65536 bytes; it is refused, not cut",
            ),
            (
                "virtio0: x\nnot a config line\n".to_owned(),
                "line 2 of the source config is not a `key: value` line",
            ),
            (
                "virtio0: x\nvirtio0: y\n".to_owned(),
                "line 2 of the source config repeats the key \"virtio0\"",
            ),
        ] {
            run.lab.add_source_config(SNAPSHOT, &config);
            assert_status(run.read_source().await, Code::FailedPrecondition, needle);
        }
        std::fs::remove_file(
            run.lab
                .root
                .join("pbs/store1")
                .join(SNAPSHOT)
                .join(SOURCE_CONFIG_BLOB),
        )
        .unwrap();
        assert_status(
            run.read_source().await,
            Code::FailedPrecondition,
            "manifest does not contain file 'qemu-server.conf.blob'",
        );
        // A refused config leaves the shape read before it in force, and the secret never
        // reached an argument or the environment.
        run.create_mirrored(9100, &[VIRTIO_ARCHIVE]).await.unwrap();
        let conf = run.conf(9100);
        assert!(conf_value(&conf, "virtio0").is_some(), "{conf}");
        // Each read restores the manifest, then the config.
        let restores: Vec<_> = run
            .lab
            .calls()
            .into_iter()
            .filter(|c| c["command"] == "restore")
            .collect();
        assert_eq!(restores.len(), 10);
        for call in &restores {
            assert_eq!(call["password_source"], "PBS_PASSWORD_FD", "{call}");
            assert!(!call.to_string().contains(PBS_PASSWORD), "{call}");
        }
        let journal = run.journal().await;
        assert!(
            journal
                .iter()
                .any(|s| s == "source.config source:qemu-server.conf failed"),
            "{journal:?}"
        );
        run.end().await;
    }
}
