"""fair share: rows served per owner and per batch, shared by every process on the database; an index of the
claims in flight by worker

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('fair_share',
    sa.Column('scope', sa.String(length=8), nullable=False),
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('served', sa.BigInteger(), nullable=False),
    sa.CheckConstraint("scope IN ('owner', 'batch')", name=op.f('ck_fair_share_scope')),
    sa.CheckConstraint('served >= 0', name=op.f('ck_fair_share_served_nonnegative')),
    sa.PrimaryKeyConstraint('scope', 'key', name=op.f('pk_fair_share'))
    )
    with op.batch_alter_table('batch_rows') as batch_op:
        batch_op.create_index('ix_batch_rows_claimed', ['claimed_by'], unique=False, sqlite_where=sa.text('claimed_until IS NOT NULL'), postgresql_where=sa.text('claimed_until IS NOT NULL'))


def downgrade() -> None:
    with op.batch_alter_table('batch_rows') as batch_op:
        batch_op.drop_index('ix_batch_rows_claimed', sqlite_where=sa.text('claimed_until IS NOT NULL'), postgresql_where=sa.text('claimed_until IS NOT NULL'))
    op.drop_table('fair_share')
