// Drives the browser demo in headless Chromium with a fake microphone playing a WAV,
// then saves what the page knows (window.duplexDemo, the received audio), what its live
// regions announced, axe-core's accessibility results and a screenshot. Run inside a
// network namespace that holds only loopback, with the server in it
// (tests/test_demo_e2e.py does both).
//
//   node demo.mjs URL WAV OUT_DIR [--until-turns N] [--close-after-audio-ms MS] [--timeout-s S]
//                                 [--no-microphone]
//
// A URL whose host is not 127.0.0.1 is resolved to 127.0.0.1 by Chromium itself: a page
// from a name, which the browser does not count as a secure origin. --no-microphone
// expects that: the page must say what to do instead of connecting.
import { createRequire } from "node:module";
import { join } from "node:path";
import { launch, run } from "./chromium.mjs";

const [url, wav, out, ...rest] = process.argv.slice(2);
const option = (name, fallback) => {
  const i = rest.indexOf(name);
  return i >= 0 ? Number(rest[i + 1]) : fallback;
};
const untilTurns = option("--until-turns", 1); // finished assistant turns to wait for
const closeAfterMs = option("--close-after-audio-ms", 0); // close the tab mid-reply instead
const timeoutMs = option("--timeout-s", 120) * 1000;
const noMicrophone = rest.includes("--no-microphone");
const host = new URL(url).hostname;
const AXE = createRequire(import.meta.url).resolve("axe-core/axe.min.js");
// WCAG 2.0, 2.1 and 2.2, levels A and AA: names, labels, ARIA, contrast
const AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa"];

const browser = await launch(wav, host);
const result = { ok: false, log: [], axe: {} };
let page = null;
await run(browser, out, result, async () => {
  const context = await browser.newContext({ permissions: ["microphone"], viewport: { width: 900, height: 900 } });
  await context.addInitScript(recordAnnouncements);
  await context.addInitScript({ path: AXE }); // window.axe in the page (as a DevTools script: no CSP applies)
  page = await context.newPage();
  page.on("console", (message) => result.log.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => result.log.push(`pageerror: ${error.message}`));
  await page.goto(url);
  if (noMicrophone) {
    await page.waitForSelector("#mic-help:not([hidden])", { timeout: 30000 });
    await page.waitForFunction(() => document.querySelector("#service").textContent === "service ready",
      null, { timeout: 60000 });
    await page.waitForTimeout(1500); // an autostart would have begun by now
    result.page = await page.evaluate(() => ({
      secure: window.isSecureContext,
      mediaDevices: typeof navigator.mediaDevices,
      help: document.querySelector("#mic-help").innerText,
      helpVisible: document.querySelector("#mic-help").checkVisibility(),
      links: [...document.querySelectorAll("#mic-help a")].map((a) => a.href),
      talkDisabled: document.querySelector("#talk").disabled,
      talkDescription: document.querySelector("#talk").getAttribute("aria-describedby"),
      connected: window.duplexDemo.connected,
    }));
    result.axe.noMicrophone = await axe(page);
    await page.screenshot({ path: join(out, "page.png"), fullPage: true });
  } else {
    result.axe.loaded = await axe(page); // as it opens (connecting: ?autostart=1)
    await page.waitForFunction(() => window.duplexDemo && window.duplexDemo.connected, null, { timeout: 60000 });
    if (closeAfterMs) {
      await page.waitForFunction((ms) => window.duplexDemo.audioReceivedMs >= ms, closeAfterMs, { timeout: timeoutMs });
      result.demo = await snapshot(page);
      await page.close(); // the tab goes away mid-reply
    } else {
      // while the caller speaks: the line being heard is on screen in its partial style
      await page.waitForSelector("#conversation li.partial", { timeout: timeoutMs });
      result.axe.partial = await axe(page);
      await page.waitForFunction(
        (n) => window.duplexDemo.assistantTurns.filter((t) => t.status !== "in_progress").length >= n,
        untilTurns,
        { timeout: timeoutMs },
      );
      await page.waitForTimeout(1500); // the reply's last audio, and the page settles
      result.axe.finished = await axe(page);
      result.demo = await snapshot(page);
      result.stats = await page.evaluate(() => window.duplexDemo.stats && window.duplexDemo.stats());
      result.recording = await page.evaluate(() => window.duplexDemo.recording && window.duplexDemo.recording());
      await page.screenshot({ path: join(out, "page.png"), fullPage: true });
    }
  }
}, async (failed) => { // what the page knew when a wait ran out
  if (page && !page.isClosed()) failed.demo = await snapshot(page);
});

function snapshot(page) {
  return page.evaluate(() => {
    const { recording, ...rest } = window.duplexDemo;
    return {
      ...JSON.parse(JSON.stringify(rest)),
      cutShown: Boolean(document.querySelector("#conversation del")),
      announcements: window.announcements,
      conversationLive: Boolean(document.querySelector("#conversation").closest(window.LIVE)),
    };
  });
}

// axe-core on the page as it is now: the violations of the WCAG A/AA rules (with the
// elements at fault), the rules that passed, and whether a partial line was on screen
function axe(page) {
  return page.evaluate(async (tags) => {
    const partial = Boolean(document.querySelector("#conversation li.partial"));
    const found = await window.axe.run(document, { runOnly: { type: "tag", values: tags }, resultTypes: ["violations"] });
    return {
      partial,
      violations: found.violations.map((v) => ({
        id: v.id, impact: v.impact, help: v.help,
        nodes: v.nodes.map((n) => ({ target: n.target, summary: n.failureSummary })),
      })),
      passes: found.passes.map((p) => p.id),
    };
  }, AXE_TAGS);
}

// In the page, before its own script: what each live region is given to announce. A
// screen reader speaks the nodes and text added to a live region (aria-live, or a role
// that implies it), so each addition is kept: {region, text}.
function recordAnnouncements() {
  window.LIVE = '[aria-live]:not([aria-live="off"]), [role="log"], [role="status"], [role="alert"]';
  window.announcements = [];
  new MutationObserver((records) => {
    for (const record of records) {
      const target = record.target.nodeType === Node.ELEMENT_NODE ? record.target : record.target.parentElement;
      const region = target && target.closest(window.LIVE);
      if (!region || region.hidden) continue;
      const added = record.type === "characterData"
        ? [record.target.textContent]
        : [...record.addedNodes].map((n) => n.textContent);
      for (const text of added) if (text.trim()) window.announcements.push({ region: region.id, text });
    }
  }).observe(document, { subtree: true, childList: true, characterData: true });
}
