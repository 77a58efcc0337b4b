"""responses

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('responses',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.BigInteger(), nullable=False),
    sa.Column('body_json', sa.Text(), nullable=False),
    sa.Column('turns_json', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_responses'))
    )
    op.create_index('ix_responses_expires_at', 'responses', ['expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_responses_expires_at', table_name='responses')
    op.drop_table('responses')
